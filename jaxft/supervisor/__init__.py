"""The supervisor side of jaxft: ``jaxft launch`` and ``jaxft coordinator``, one program that
starts, watches and restarts the workers of one node and never imports jax (a test checks it).

It talks to the workers only through :mod:`jaxft.protocol`: their environment, the files of
the state dir they share, their exit codes, and the events they log.
"""
