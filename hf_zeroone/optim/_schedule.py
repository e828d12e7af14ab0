"""Where to freeze the variance when only the run length and the LR warm-up are known.

1-bit Adam freezes Adam's ``v`` at ``freeze_step`` and compresses from there; 0/1 Adam freezes it
at ``var_freeze_step``. The freeze must come after ``v`` has settled, and ``v`` settles later than
the learning rate's warm-up ends: on the BERT masked-LM workload of ``recipes/convergence.py``
(500 steps, warm-up 50), the ``sqrt(v)`` of the attention query and key weights is about 1e-6 at
step 50 and grows 16-35x by step 200, while every other tensor stays within 0.75-2.4x. A ``v``
frozen at step 50 makes those steps far too large: 1-bit Adam ends 4.35% above AdamW's held-out
loss with the freeze at 50, 0.74% above with the freeze at 100 (0/1 Adam: 2.17% and 1.27%).

DeepSpeed's 1-bit Adam tutorial gives the same advice from the paper's BERT runs
(Tang et al., arXiv 2102.02888): freeze after 15-25% of the training steps. The rule here is the
later of the end of the LR warm-up and :data:`FREEZE_PERCENT` % of the run.
"""

from __future__ import annotations

__all__ = ["FREEZE_PERCENT", "recommended_freeze_step"]

#: the earliest point of the run, in percent of its steps, at which the variance is frozen
FREEZE_PERCENT = 20


def recommended_freeze_step(num_training_steps: int, warmup_steps: int = 0) -> int:
    """``max(warmup_steps, ceil(FREEZE_PERCENT / 100 * num_training_steps))``, at least 1.

    Use it for 1-bit Adam's ``freeze_step`` with your LR warm-up, and for 0/1 Adam's
    ``var_freeze_step`` with twice your LR warm-up (what ``ZeroOneTrainer`` derives)::

        OneBitAdam(params, lr=1e-3, freeze_step=recommended_freeze_step(10_000, warmup_steps=500))
        ZeroOneAdam(params, lr=1e-3, var_freeze_step=recommended_freeze_step(10_000, warmup_steps=2 * 500))
    """
    if isinstance(num_training_steps, bool) or not isinstance(num_training_steps, int) or num_training_steps < 1:
        raise ValueError(f"num_training_steps must be a positive int (optimizer steps), got {num_training_steps!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0 (the LR warm-up's steps), got {warmup_steps!r}")
    return max(1, warmup_steps, -(-num_training_steps * FREEZE_PERCENT // 100))
