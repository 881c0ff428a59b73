"""What a functp checkpoint folder holds beside DCP's own files: their names, the keys
functp keeps in DCP's state dict, and the format number (read by every io module)."""
from __future__ import annotations

FORMAT = 2                              # of the files functp writes beside DCP's
# in every checkpoint of format 2 on: a one-element tensor holding the format. Its
# presence in .metadata says the tree file and the checksums must be there too.
FORMAT_KEY = "__functp_format__"
# what format 1 stored in DCP (still read): the tree's structure as a pickle (read
# only with trusted=True) and, when the save wrote checksums, this mark
TREE_KEY = "__functp_treespec__"
CHECKED_KEY = "__functp_checksummed__"
OWN = {FORMAT_KEY, TREE_KEY, CHECKED_KEY}
SUMS = ".functp_checksums.json"       # CRC32s of the stored bytes; the mark of a finished save
TREE = ".functp_tree.json"            # the tree's structure and non-tensor leaves, as JSON
METADATA = ".metadata"                # DCP's metadata file (filesystem.py: _metadata_fn)
TRUST = ("if you wrote this checkpoint yourself and trust the folder, load it once with "
         "trusted=True (which unpickles as DCP does) and save it again: the new files "
         "load without it")
