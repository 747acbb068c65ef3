#!/usr/bin/env bash
# Prints 1 when this machine has a working NVIDIA driver and at least one GPU (nvidia-smi lists one), else 0: what
# `make setup` installs for. An installed CUDA library alone is not a GPU. GPU=0 or GPU=1 on make's command line
# overrides it.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then echo 1; else echo 0; fi
