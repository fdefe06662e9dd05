import os
# every graph is checked against its stage's spec in tests
os.environ.setdefault("SPEC", "1")
