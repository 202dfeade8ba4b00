#!/usr/bin/env python3
"""Writes a Flash-shaped config with N layers (stdout): configs/flash-shaped-24-layers.json
with num_hidden_layers = N and the real V4-Flash layer schedule continued (2 sliding layers,
then CSA (ratio 4) and HCA (ratio 128) alternating; hash routing in the first 3).

    python3 scripts/flash-shaped-config.py 30 > /tmp/flash-30.json
"""
import json
import os
import sys

n = int(sys.argv[1])
if n < 1:
    sys.exit("layers must be >= 1")
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "..", "configs", "flash-shaped-24-layers.json")) as f:
    cfg = json.load(f)
cfg["num_hidden_layers"] = n
cfg["compress_ratios"] = ([0, 0] + [4 if i % 2 == 0 else 128 for i in range(max(n - 2, 0))])[:n]
cfg["num_hash_layers"] = min(3, n)
json.dump(cfg, sys.stdout, indent=1)
print()
