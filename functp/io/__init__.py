"""Checkpoints: functp's own (``save``/``load``/``full_state_dict`` through DCP, with the
tree file, checksums and safe reading beside them) and transformers' safetensors
folders read block by block (for ``from_pretrained``)."""
