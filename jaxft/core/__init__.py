"""The decisions of the atomic step, as pure code: no sockets, no threads, no jax.

Every rule that keeps the members of a step in agreement lives here, as functions and small
state machines over events (answers of the coordination service, death records, the step's
agreed votes); the worker's I/O layer (:mod:`jaxft.worker`) feeds them and carries out what
they decide, and a simulation drives them through thousands of interleavings
(``tests/simulation.py``). Read ``docs/protocol.md`` first.

* :mod:`~jaxft.core.liveness`: a liveness query's answer, final or asked again;
* :mod:`~jaxft.core.commit`: one member's step, from its entry to commit or fail;
* :mod:`~jaxft.core.step`: what the members decide from a step's agreed votes;
* :mod:`~jaxft.core.votes`: the votes' layout;
* :mod:`~jaxft.core.coldstart`: a process named in an entry answer it never got;
* :mod:`~jaxft.core.batching`: how many steps one commit query covers (``commit_every="auto"``);
* :mod:`~jaxft.core.spares`: the width, and when a spare enters;
* :mod:`~jaxft.core.rejoin`: who is new, who donates, who is refused;
* :mod:`~jaxft.core.runs`: where a process's ``run()`` stands.
"""
