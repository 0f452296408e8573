"""The AOT stage: Dynamo graph -> AOTAutograd -> our partition -> kernel modules (see driver.py)."""
