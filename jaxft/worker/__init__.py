"""The worker side of jaxft: what runs inside each training process (imports jax).

``initialize()`` (:mod:`~jaxft.worker.runtime`), the atomic step (:mod:`~jaxft.worker.membership`),
the training loop (:mod:`~jaxft.worker.loop`, :mod:`~jaxft.worker.trainer`), rejoin and transfer,
data and checkpoints. The decisions of the step protocol live in :mod:`jaxft.core` (no I/O).
"""
