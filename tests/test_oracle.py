"""The oracle: a rewritten K-tower graph trains exactly like one device fed all K*B examples.

Every case also trains the un-rewritten graph and checks that it does NOT match, so the
comparison is able to fail.
"""

import pytest

from bnrewrite import rewrite_graph
from models import Spec, make_batches, max_rel_error, one_device_run, rel_errors, towers_once, train, unrewritten_run

STEPS = 3
#: Float32 graphs that are mathematically equal differ by ~1e-6; half precision rounds BN's
#: input and output to 11 (float16) or 8 (bfloat16) bits, so its bound is that rounding.
TOLERANCE = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 2e-2}
UNSYNCED_AT_LEAST = 1e-2

CASES = [
    Spec(towers=2, layer="legacy", data_format="NHWC"),
    Spec(towers=4, layer="legacy", data_format="NHWC"),
    Spec(towers=2, layer="legacy", data_format="NCHW"),
    Spec(towers=4, layer="legacy", data_format="NCHW"),
    Spec(towers=2, layer="fused_op", data_format="NHWC"),
    Spec(towers=4, layer="fused_op", data_format="NCHW"),
    Spec(towers=2, layer="fused_op", data_format="NHWC", dtype="float16"),
    Spec(towers=4, layer="legacy", data_format="NHWC", dtype="float16"),
    # float16's elementwise passes (channels first, as on GPU towers); channels last takes the kernels
    Spec(towers=2, layer="legacy", data_format="NCHW", dtype="float16"),
    Spec(towers=2, layer="fused_op", data_format="NCHW", dtype="bfloat16"),
]


def _case_id(spec: Spec) -> str:
    return f"K{spec.towers}-{spec.layer}-{spec.data_format}-{spec.dtype}"


def run_oracle(spec: Spec, **options) -> tuple[float, float, dict]:
    """(synced error, unsynced error, per-quantity synced errors) against the reference."""
    built = towers_once(spec)  # the graph, the reference and the un-rewritten graph do not depend
    result = rewrite_graph(built.graph, **options)  # on the options: built and trained once for every backend
    expected = one_device_run(spec, STEPS)
    unsynced = unrewritten_run(spec, STEPS)
    synced = train(result.graph_def, built, make_batches(spec, STEPS), num_devices=spec.towers)
    return max_rel_error(synced, expected), max_rel_error(unsynced, expected), rel_errors(synced, expected)


@pytest.mark.parametrize("backend", ["local", "collective"])
@pytest.mark.parametrize("spec", CASES, ids=_case_id)
def test_rewritten_towers_train_like_one_device(spec, backend):
    synced, unsynced, detail = run_oracle(spec, backend=backend)
    print(f"{_case_id(spec)} {backend}: synced {synced:.2e}, unsynced {unsynced:.2e}")
    assert unsynced > UNSYNCED_AT_LEAST, "the un-rewritten graph matched: this oracle cannot fail"
    assert synced <= TOLERANCE[spec.dtype], detail
