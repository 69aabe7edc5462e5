"""Test worker: :func:`jaxft.worker.transfer.broadcast_tree` of a mixed-dtype tree from a donor.

Every process builds a tree of the same structure, shapes and dtypes; only the donor's holds
the reference values (the others hold other values). Per transfer it logs ``broadcast``:
the result's sha256 and leaf dtypes/shapes, the reference's sha256 (the same on every
process: it is computed from the seed), whether every leaf equals the reference bit for bit,
and the transfer's extra host memory: the tracemalloc peak of numpy allocations over the
call, less what was traced before it and less the result's own new leaves.
"""

import argparse
import tracemalloc

import jaxft

parser = argparse.ArgumentParser()
parser.add_argument("--donors", default="1,2")
args, _ = parser.parse_known_args()

rt = jaxft.initialize()

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxft.worker import transfer


def make_tree(seed: int, big: int) -> dict:
    r = np.random.default_rng(seed)
    return {
        "f32": r.standard_normal(big).astype(np.float32),
        "bf16": r.standard_normal((33, 7)).astype(ml_dtypes.bfloat16),
        "i8": r.integers(-128, 127, 1001, dtype=np.int8),  # 1001 bytes: not a multiple of 4
        "mask": r.random((5, 3)) > 0.5,
        "scalar": np.int64(r.integers(1 << 40)),  # 0-d
        "empty": np.zeros((0, 4), np.float32),
        "nested": [np.float64(r.random()), r.standard_normal((3, 1, 5)).astype(np.float16),
                   jnp.asarray(r.standard_normal(777).astype(np.float32))],  # a jax array leaf
        "odd": r.integers(0, 255, 13, dtype=np.uint8),
        "transposed": r.standard_normal((40, 30)).astype(np.float32).T,  # not C-contiguous
    }


def leaf_bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


group = jaxft.ElasticGroup()
with group.step() as m:  # fresh processes: the first step builds the data plane
    pass
# (donor, elements of the big leaf, chunk bytes): chunks that straddle leaves and cut a leaf
# up; an odd chunk size; one chunk for the whole tree (padded short last chunk)
cases = [(int(d), 2_000_000, 1 << 20) for d in args.donors.split(",")] + [(0, 3000, 4099), (2, 100, 1 << 20)]
for case, (donor, big, chunk) in enumerate(cases):
    reference = make_tree(1234 + big, big)
    tree = reference if rt.process_id == donor else make_tree(rt.process_id + 99, big)
    with group.step() as m:
        new_bytes = 0 if rt.process_id == donor else transfer.tree_nbytes(tree)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        got = transfer.broadcast_tree(tree, donor, m.mesh, chunk_bytes=chunk)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    ok = leaf_bits(got) == leaf_bits(reference)
    same_tree = jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(reference)
    rt.events.log("broadcast", case=case, donor=donor, chunk=chunk, sha256=transfer.tree_sha256(got),
                  reference_sha256=transfer.tree_sha256(reference), bit_exact=ok, same_structure=same_tree,
                  leaves=[[np.asarray(x).dtype.str, list(np.shape(x))] for x in jax.tree_util.tree_leaves(got)],
                  reference_leaves=[[np.asarray(x).dtype.str, list(np.shape(x))]
                                    for x in jax.tree_util.tree_leaves(reference)],
                  tree_bytes=transfer.tree_nbytes(reference), extra_bytes=peak - before - new_bytes)
group.finish()
