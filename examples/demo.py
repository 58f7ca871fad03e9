"""`make demo`: a real fully-async training run on CPU, with rollouts and weight pushes.

A tiny random Qwen2 learns a toy task (answer with tokens of a band of the vocabulary) while
rollouts stream through the AsyncServerManager and every trainer step's weights are pushed into
the vLLM engine. Prints a per-step table and writes demo.png (reward, staleness, push times).
"""

from __future__ import annotations

import uvloop
from fully_async import main

if __name__ == "__main__":
    uvloop.run(main(steps=30, max_staleness=2, plot_path="demo.png"))
