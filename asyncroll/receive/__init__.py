"""One worker's half of a push, without vLLM: the load plan that copies each bucket into the
served parameters (``load_plan``), the check of what a push loaded (``check``), and what undoing
a failed push takes (``rollback``). They import torch and the transport, never vLLM, and are
tested on plain ``torch.nn.Module``s (tests/test_receive.py, tests/test_load_plan.py).

``asyncroll.vllm.worker`` is the adapter that maps vLLM's weight-transfer calls onto them; a
change to how a push is loaded, checked or undone belongs here, a change to how vLLM calls it
there.
"""

from asyncroll.receive.check import PushCheck, check_delivered
from asyncroll.receive.load_plan import LoadPlan, PlanStatistics
from asyncroll.receive.rollback import Rollback

__all__ = ["LoadPlan", "PlanStatistics", "PushCheck", "Rollback", "check_delivered"]
