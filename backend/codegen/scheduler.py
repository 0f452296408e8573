"""Group ``Compute`` steps into kernels.

A kernel iterates over one index space ``ranges`` with some dimensions ``reduced`` (none for a
pointwise kernel). Its members take one of three roles:

- ``full``: a pointwise step over all of ``ranges`` (one value per element),
- ``reduce``: a reduction of ``ranges`` over ``reduced`` (one value per row),
- ``row``: a pointwise step over the rows (``ranges`` without the reduced dimensions, or with
  them as size 1), e.g. ``rsqrt(var + eps)`` between two reductions.

and two more that make a kernel's *tail* (``_Open.tail_of``): a loss's mean over its rows after the
row statistics (a cross-entropy: each row's log-sum-exp and picked logit, then their sum over every
row divided by the count of counted rows). As its own kernel the mean is a launch of one program
that reads the rows' values back; as a tail, each program adds its rows' share to a slot of its own
and the last program to finish adds the slots in order (``tail.py``):

- ``tail``: a sum over every row of a row value (a step over the kept dimensions, all reduced),
- ``final``: a pointwise step over one element that reads only tail members (the mean's division).

Nothing else in the kernel may read a tail or final member: their values exist only at the end.

A step joins the open kernel when its role fits and every value it reads from a member is read at
exactly the element that member computes (so it can stay in registers). A step that does not fit
is passed over, and the kernel keeps taking the later steps that fit and do not depend on a
passed-over one; then it closes and the first passed-over step opens the next kernel. So a
backward whose column sums (weight gradients) sit between the steps of a row computation gets one
row kernel and one kernel per group of column sums, not a row kernel cut in two around them. Aten
calls that do not read the open kernel's buffers run before it, so an aten call between two
fusable steps does not split them; a matrix product that reads the kernel's result is passed over
like a step that does not fit (it runs after the kernel), and so is every product after it, in
order; later steps that read the kernel still join it (Llama's SiLU gradient past the up
projection's two GEMMs), and a step that reads nothing of it joins only where no step reads its
value (else its value would be stored for a reader that could have computed it in registers) or
where it is a value a row;
once a step was passed over, other aten calls keep their order.
Softmax, log_softmax, layer norm forward and backward each end up as one kernel.

A pointwise step over the kernel's dimensions with adjacent ones merged (a view for a matrix
product of a row computation's result) joins as ``full``, each of its dimensions the linear index
of the run it merges (``_Open.merged``), and one with a dimension cut into several, each their
quotient and remainder (``_Open.split``); one over them in another order, where its stores run along
the kernel's rows as its reads do (``_Open.permuted``); one over merged runs in another order, where
its loads run along the rows too (``_Open.regrouped``: BERT's softmax cast to bf16 as the transposed
(B*H, S, S) its backward reads).

A pointwise kernel over rows longer than a block that reads values of each row walks rows and
columns as a looped reduction does (``_by_rows``): its row values are computed once a row block.

Scatters and scans are kernels of their own (``Compute.alone``): a scatter writes where its data
says, so no other step may read its buffer in the same kernel, and a scan's element depends on
its whole row. Scatters over one space into buffers no member reads share a kernel (a decode
step's K and V cache writes: ``_Open._scatters_side_by_side``). A scatter writes into a buffer an
earlier step filled (``writes_input``): steps after it never join a kernel opened before it, as for
any write into an existing buffer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import sympy

from cgtrees.codegen import heuristics, ir, view_maps

WINDOW_LOADS = 9  # loads of one buffer per element that make a step a window (a 3x3 convolution's)
LATE = ("tail", "final")  # roles whose values exist only after every program of the kernel ran
_PRODUCTS = ("aten.mm.", "aten.bmm.", "aten.addmm.", "aten.baddbmm.")  # aten calls that only read their inputs


@dataclass(frozen=True)
class Member:
    step: ir.Compute
    role: str  # "full" | "reduce" | "row" | "tail" | "final"
    subs: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # the step's own index symbols -> kernel symbols

    @property
    def name(self) -> str:
        return self.step.name

    def body(self) -> ir.Expr:
        return ir.map_indices(self.step.body, dict(self.subs))

    def store_index(self) -> sympy.Expr:
        own = ir.index_symbols(len(self.step.ranges))
        if self.role in ("reduce", "tail") or self.step.scatter is not None:
            return self.step.store_index(own).xreplace(dict(self.subs))
        return self.step.layout.index(own).xreplace(dict(self.subs))


@dataclass(frozen=True)
class Kernel:
    ranges: tuple[sympy.Expr, ...]
    reduced: tuple[int, ...]
    members: tuple[Member, ...]
    stored: frozenset[str] = frozenset()

    @property
    def is_reduction(self) -> bool:
        """Some member reduces (``reduced`` alone may be a pointwise kernel's rows: ``_by_rows``)."""
        return any(m.role == "reduce" for m in self.members)

    @property
    def two_d(self) -> bool:
        """Its blocks are rows x columns (``[XBLOCK, RBLOCK]``, ``reduced`` the columns)."""
        return bool(self.reduced)


Item = ir.Extern | ir.Alias | Kernel


@dataclass
class _Open:
    ranges: tuple[sympy.Expr, ...]
    reduced: tuple[int, ...] = ()
    members: list[Member] = field(default_factory=list)
    deferred: list[ir.Alias] = field(default_factory=list)  # views of members, valid after the kernel

    def names(self) -> set[str]:
        return {m.name for m in self.members} | {a.name for a in self.deferred}

    def close(self) -> list[Item]:
        reduced = self.reduced or _by_rows(self.ranges, self.members)
        return [Kernel(self.ranges, reduced, tuple(self.members)), *self.deferred]

    # ---------------------------------------------------------------------------------- joining
    def role_of(self, step: ir.Compute) -> tuple[str, dict] | None:
        own = ir.index_symbols(len(step.ranges))
        kernel = ir.index_symbols(len(self.ranges))
        identity = dict(zip(own, kernel))
        if step.is_reduction:
            if step.ranges == self.ranges and (not self.reduced or step.reduced == self.reduced):
                return "reduce", identity
            return self.tail_of(step)
        if step.ranges == self.ranges:
            return "full", identity
        if not self.reduced:
            return None
        unit = self.unit_dims(step)
        if unit is not None:
            return "full", unit
        if all(n == 1 for n in step.ranges) and self._reads_only_tail(step):
            return "final", {s: sympy.Integer(0) for s in own}
        keep = tuple(sympy.Integer(1) if d in self.reduced else n for d, n in enumerate(self.ranges))
        if step.ranges == keep:
            return "row", {s: (sympy.Integer(0) if d in self.reduced else kernel[d]) for d, s in enumerate(own)}
        # the kept dims, size-1 dims aside: a (C,) running statistic is a row of a (1, C, 1, 1) one
        kept = [d for d in range(len(self.ranges)) if d not in self.reduced and self.ranges[d] != 1]
        mine = [i for i, n in enumerate(step.ranges) if n != 1]
        if [step.ranges[i] for i in mine] == [self.ranges[d] for d in kept]:
            subs = {s: sympy.Integer(0) for s in own}
            subs.update({own[i]: kernel[d] for i, d in zip(mine, kept)})
            return "row", subs
        return None

    def unit_dims(self, step: ir.Compute) -> dict | None:
        """A pointwise step over a row kernel's dimensions with size-1 ones added or left out (a
        loss's gradient over ``[N, V]`` rows written as the ``[1, N, V]`` logits it flows back to)
        as a ``full`` member: its other dimensions, in order, are the kernel's."""
        if step.is_reduction or step.scatter is not None or len(step.ranges) == len(self.ranges):
            return None
        return self._onto(step, [d for d, n in enumerate(self.ranges) if n != 1])

    def tail_of(self, step: ir.Compute) -> tuple[str, dict] | None:
        """A sum over every row of a row value (a loss's sum over its rows) as a ``tail`` member of
        a row kernel: the step's dimensions, size-1 ones aside, are the kernel's kept ones, and it
        reduces them all. Sums only (their shares add up in any grouping, and deterministically in
        the order the last program adds them); a max or a mean would need shares of their own kind."""
        if not self.reduced or step.reduction != ir.Reduce.SUM or step.alone or step.writes_input:
            return None
        if step.reduced != tuple(range(len(step.ranges))):
            return None
        subs = self._onto(step, [d for d in range(len(self.ranges)) if d not in self.reduced and self.ranges[d] != 1])
        return None if subs is None else ("tail", subs)

    def _onto(self, step: ir.Compute, dims: list[int]) -> dict | None:
        """The step's dimensions of size other than 1, in order, as the kernel's ``dims`` (the rest at
        index 0); None where their sizes differ or there are none."""
        mine = [i for i, n in enumerate(step.ranges) if n != 1]
        if not dims or not mine or [step.ranges[i] for i in mine] != [self.ranges[d] for d in dims]:
            return None
        own, kernel = ir.index_symbols(len(step.ranges)), ir.index_symbols(len(self.ranges))
        subs = {s: sympy.Integer(0) for s in own}
        subs.update({own[i]: kernel[d] for i, d in zip(mine, dims)})
        return subs

    def _reads_only_tail(self, step: ir.Compute) -> bool:
        """Whether a one-element step reads tail (or final) members and nothing else."""
        late = {m.name for m in self.members if m.role in LATE}
        loads = ir.loads(step.body)
        return bool(late) and bool(loads) and all(ld.buf in late for ld in loads) and not step.alone \
            and not step.writes_input

    def permuted(self, step: ir.Compute) -> list[dict]:
        return view_maps.permuted(self.ranges, step) if self.reduced else []

    def merged(self, step: ir.Compute) -> list[dict]:
        return view_maps.merged(self.ranges, step) if self.members else []

    def split(self, step: ir.Compute) -> list[dict]:
        return view_maps.split(self.ranges, step) if self.members else []

    def regrouped(self, step: ir.Compute) -> list[dict]:
        return view_maps.regrouped(self.ranges, step) if self.reduced else []

    def try_add(self, step: ir.Compute) -> bool:
        if self.members and (step.alone or self.members[0].step.alone) and not self._scatters_side_by_side(step):
            return False
        fit = self.role_of(step)
        merged = self.merged(step) + self.split(step) if fit is None else []
        fits = [fit] if fit is not None else [("full", subs) for subs in merged + self.permuted(step)]
        regrouped = [("full", subs, True) for subs in self.regrouped(step)] if fit is None else []
        for role, subs, regroups in [(role, subs, False) for role, subs in fits] + regrouped:
            member = Member(step, role, tuple(subs.items()))
            if fit is None and not self._stores_along(member):
                continue
            if regroups and not self._loads_along(member):
                continue
            if self._reads_line_up(member):
                break
        else:
            return False
        if step.writes_input and not self._only_aligned_reads(member):
            return False
        reduced = self.reduced or (step.reduced if step.is_reduction else ())
        checked = self.members if not self.reduced else []  # the others were, when they joined
        if reduced and not all(_window_runs_along(m, reduced) for m in [*checked, member]):
            return False
        if step.is_reduction and not self.reduced:
            self.reduced = step.reduced
        self.members.append(member)
        return True

    def _scatters_side_by_side(self, step: ir.Compute) -> bool:
        """A scatter joins a kernel of scatters over the same values' space (a decode step's K and V
        cache writes) into other buffers, where no member reads what it writes: programs run in no
        order, so a read of its buffer could see the new values or the old ones, and of two writes
        into one buffer either could land last."""
        return step.scatter is not None and all(
            m.step.scatter is not None and m.step.ranges == step.ranges and m.step.name != step.name
            for m in self.members) and all(ld.buf != step.name for m in self.members for ld in ir.loads(m.body()))

    def _reads_line_up(self, member: Member) -> bool:
        """Every value ``member`` reads from a member is read at the element that member computes
        (so it stays in registers), and nothing it reads is written later in the kernel."""
        by_name = {m.name: m for m in self.members}
        deferred = {a.name for a in self.deferred}
        written = {m.name for m in self.members if m.step.writes_input}
        for load in ir.loads(member.body()):
            if load.buf in deferred or load.buf in written:
                return False
            producer = by_name.get(load.buf)
            if producer is None:
                continue
            if member.role in ("row", "tail") and producer.role == "full":
                return False  # a row value cannot depend on a whole-row computation
            if producer.role in LATE and member.role != "final":
                return False  # a tail's value exists only once every program added its share
            if not self._same_element(load.index, producer.store_index()):
                return False
        return True

    def _same_element(self, a: sympy.Expr, b: sympy.Expr) -> bool:
        """Whether two offsets are equal at every index of the kernel. A dimension of size 1 has only
        index 0, and its stride may be anything (a decode step's batch of 1 viewed away for the matrix
        product that reads the row kernel's result), so its symbol counts as 0."""
        ones = {ir.index_symbol(d): 0 for d, size in enumerate(self.ranges) if size == 1}
        return sympy.expand((a - b).xreplace(ones)) == 0

    def _stores_along(self, member: Member) -> bool:
        """Whether a permuted or merged member writes its output along the kernel's innermost
        (reduced) dimension no more spread out than the kernel's first member reads along it (a
        channels-last output of a channels-last input: both with stride 1), so joining costs no
        coalescing. BERT's softmax, cast to bf16 and transposed for the backward's matrix product,
        wrote its rows a column apart: 0.7 ms a step more in the row kernel than in its own."""
        inner = ir.index_symbol(self.reduced[-1] if self.reduced else len(self.ranges) - 1)
        reads = _read_strides(self.members[0], inner)
        step = _stride(member.store_index(), inner)
        return bool(reads) and step is not None and abs(step) <= min(reads)

    def _loads_along(self, member: Member) -> bool:
        """Whether every load of ``member`` runs along the kernel's innermost (reduced) dimension no
        more spread out than the kernel's first member reads (a regrouped step reading another
        tensor transposed would load each row a column apart)."""
        inner = ir.index_symbol(self.reduced[-1])
        limit = min(_read_strides(self.members[0], inner), default=None)
        steps = [_stride(load.index, inner) for load in ir.loads(member.body())]
        return limit is not None and all(d is not None and abs(d) <= limit for d in steps)

    def _only_aligned_reads(self, member: Member) -> bool:
        """An input written in place may only be read at the element being written, by a step of
        the write's role (a row step of a reduction kernel writes once per row)."""
        target = member.store_index()
        for m in [*self.members, member]:
            for load in ir.loads(m.body()):
                if load.buf == member.name and (m.role != member.role or not self._same_element(load.index, target)):
                    return False
        return True


def _stride(index: sympy.Expr, symbol: sympy.Symbol) -> sympy.Expr | None:
    """How far ``index`` moves at each step of ``symbol``: a number, or None where the steps differ
    (a floor division of it: RoFormer's rotary embedding reads each position's pair as ``x // 2``)."""
    step = sympy.diff(index, symbol)
    return step if step.is_number else None


def _read_strides(member: Member, inner: sympy.Symbol) -> list[sympy.Expr]:
    """The moving loads' strides along ``inner`` (their sizes), where each is a number."""
    strides = (_stride(load.index, inner) for load in ir.loads(member.body()))
    return [abs(s) for s in strides if s is not None and s != 0]


def _by_rows(ranges: tuple[sympy.Expr, ...], members: list[Member]) -> tuple[int, ...]:
    """The columns of a pointwise kernel over rows longer than a block that reads values of the
    row (a loss's gradient reads each row's max, log-sum-exp, target and scale beside its logits):
    it walks ``[rows, columns]`` blocks as a looped reduction does, so what depends on the row
    alone is computed once a block of the row, not once an element, and no element's row and column
    are divided out of its flat index. Only where every member writes its rows contiguously."""
    n = sympy.sympify(ranges[-1]) if len(ranges) > 1 else sympy.Integer(0)
    if not members or not n.is_number or int(n) <= heuristics.PERSISTENT_LIMIT:
        return ()
    column = ir.index_symbol(len(ranges) - 1)
    for m in members:
        if m.role != "full" or m.step.alone or m.step.writes_input or sympy.diff(m.store_index(), column) != 1:
            return ()
    loads = [ld.index for m in members for ld in ir.loads(m.body())]
    if not any(ir.is_kernel_symbol(s) and s != column for i in loads for s in sympy.sympify(i).free_symbols
               if column not in sympy.sympify(i).free_symbols):
        return ()
    return (len(ranges) - 1,)


def _window_runs_along(member: Member, reduced: tuple[int, ...]) -> bool:
    """Whether a pointwise member that reads a window (``WINDOW_LOADS`` or more places of one
    buffer per element: an unrolled convolution or pooling) reads it along the reduction's innermost
    dimension with stride 1, where a reduction kernel's loads coalesce. Otherwise it keeps out of
    the reduction kernel (its own kernel walks the output in memory order): mobilenet_v3_small's
    squeeze-excite mean over (H, W) of a channels-last depthwise convolution took the convolution
    in with it, every window element read across the channels' stride (its inference call 0.59 ms
    became 1.62 ms on an H200). A convnext layer norm over the channels of that convolution reads
    along them and keeps it."""
    if member.role != "full":
        return True
    counts = Counter(load.buf for load in ir.loads(member.step.body))
    window = {buf for buf, n in counts.items() if n >= WINDOW_LOADS}
    if not window:
        return True
    inner = ir.index_symbol(reduced[-1])
    return all(abs(sympy.diff(load.index, inner)) in (0, 1) for load in ir.loads(member.body()) if load.buf in window)


def schedule(program: ir.Program) -> list[Item]:
    """Steps in program order -> kernels, aten calls and aliases in execution order."""
    items: list[Item] = []
    pending = list(program.steps)
    fusable = _read_by_steps(program.steps)
    while pending:
        step = pending.pop(0)
        if not isinstance(step, ir.Compute):
            items.append(step)
            continue
        kernel = _Open(step.ranges)
        ok = kernel.try_add(step)
        assert ok, step.name
        if not step.alone or step.scatter is not None:  # a scatter may take scatters beside it
            pending = _fill(kernel, pending, items, fusable)
        items.extend(kernel.close())
    return _mark_stored(items, program)


def _fill(kernel: _Open, pending: list[ir.Step], items: list[Item], fusable: set[str]) -> list[ir.Step]:
    """Add to ``kernel`` every later step that fits it, looking past steps that do not (a column
    sum between a row kernel's steps no longer splits the row kernel in two); return the steps
    left for later kernels, in program order. Aten calls that read none of the kernel's buffers
    run before it (appended to ``items``). Nothing moves past a step it depends on, an aten call
    that a passed-over step must precede, or a write into a graph input that was passed over.
    ``fusable``: the values some step reads (which a later kernel could compute in registers)."""
    left: list[ir.Step] = []
    passed: set[str] = set()  # steps passed over: whatever reads them must wait too
    after_product = False  # past a matrix product, a step that reads nothing of the kernel, is not a row's value
    # and is read by a step (that might compute it in registers) waits
    for i, step in enumerate(pending):
        if isinstance(step, ir.Compute):
            if step.writes_input and passed:
                return left + pending[i:]  # a passed-over step may read the input before this write
            reads = _reads_step(step)
            joins = not after_product or reads & kernel.names() or step.name not in fusable or _a_row(kernel, step)
            if not reads & passed and joins and kernel.try_add(step):
                continue
            if step.writes_input:
                return left + pending[i:]
            passed.add(step.name)
            left.append(step)
        elif isinstance(step, ir.Alias):
            if step.base in passed:
                passed.add(step.name)
                left.append(step)
            elif step.base in kernel.names():
                kernel.deferred.append(step)
            else:
                items.append(step)
        elif step.target.startswith(_PRODUCTS) and (passed or _extern_reads(step) & kernel.names()):
            passed.add(step.name)  # a matrix product of the kernel's result (or after one) waits for the
            left.append(step)  # kernel, in order, and later steps that read the kernel still join it (the
            after_product = True  # softmax's bf16 copy after the bmm; SiLU's gate gradient after the up
            # projection's two GEMMs). A step that does not read it, where a step reads its values,
            # would store them for readers past the products that would compute them in registers: it
            # waits (a layer norm's statistics recomputed in the backward). Casts of weight gradients join.
        else:
            if passed or _extern_reads(step) & kernel.names():
                return left + pending[i:]  # aten calls keep their order among the passed-over steps
            items.append(step)
    return left


def _a_row(kernel: _Open, step: ir.Compute) -> bool:
    """Whether ``step`` is a pointwise step over the kernel's rows: one value a row to store, nothing
    full-size to read for it (a padding mask's cast beside an embedding's layer norm)."""
    role = kernel.role_of(step)
    return role is not None and role[0] == "row"


def _read_by_steps(steps: list[ir.Step]) -> set[str]:
    """The buffers some ``Compute`` step reads, directly or through a view."""
    read = {buf for step in steps if isinstance(step, ir.Compute) for buf in _reads_step(step)}
    for step in reversed(steps):
        if isinstance(step, ir.Alias) and step.name in read:
            read.add(step.base)
    return read


def _reads_step(step: ir.Compute) -> set[str]:
    return {load.buf for load in ir.loads(step.body)}


def _extern_reads(step: ir.Extern) -> set[str]:
    names: set[str] = set()

    def walk(v: object) -> None:
        if isinstance(v, ir.BufRef):
            names.add(v.name)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(step.args)
    walk([v for _, v in step.kwargs])
    return names


def reads(item: Item) -> set[str]:
    """Buffers an item reads."""
    if isinstance(item, ir.Extern):
        return _extern_reads(item)
    if isinstance(item, ir.Alias):
        return {item.base}
    own = {m.name for m in item.members if not m.step.writes_input}
    indirect = [e for m in item.members if m.step.scatter is not None for e in m.step.scatter.indirect]
    loaded = {ld.buf for e in [*(m.step.body for m in item.members), *indirect] for ld in ir.loads(e)}
    return (loaded - own) | {m.name for m in item.members if m.step.scatter is not None}  # a scatter adds to its buffer


def _mark_stored(items: list[Item], program: ir.Program) -> list[Item]:
    """A member's buffer is written to memory only if something outside its kernel reads it."""
    outside: dict[int, set[str]] = {}
    needed = {o for o in program.outputs if isinstance(o, str)}
    for i, item in enumerate(items):
        outside[i] = reads(item)
    out: list[Item] = []
    for i, item in enumerate(items):
        if isinstance(item, Kernel):
            others = set().union(*(outside[j] for j in range(len(items)) if j != i)) | needed
            stored = frozenset(m.name for m in item.members if m.name in others or m.step.writes_input)
            item = Kernel(item.ranges, item.reduced, item.members, stored)
        out.append(item)
    return out
