"""The quickstart notebook runs top to bottom in plain Jupyter (``jupyter nbconvert --execute``,
from the notebook's folder) and its checks hold (CPU: the float64 reference against the notebook's
own dense softmax; GPU: the kernels too); the stored copy carries the outputs of a GPU run, or none."""
import importlib.util
import os
import subprocess
import sys

import pytest
from _scripts import ROOT, load_script
from conftest import gpu_count

NB = ROOT / "examples" / "quickstart.ipynb"

MASK_NAMES = ("NullMask()", "CausalMask()", "SlidingWindowCausalMask(window=16)", "ChunkedMask(chunk=32)",
              "ChunkedCausalMask(chunk=32)")

#: CHECK lines every run prints (one per feature the notebook walks through).
CPU_CHECKS = (
    ("reference vs dense softmax: out", "reference vs dense softmax: lse")
    + tuple(f"reference vs dense: {m}" for m in MASK_NAMES)
    + ("prefix context: causal result unchanged by cache_offsets", "q_start_pos: out vs dense",
       "paged cache vs dense", "chunked merge (24 keys per chunk) vs one-shot: out",
       "merge_states on NumPy vs the merge written here", "mla_prefill_chunked on NumPy (chunk_size=24) vs one-shot",
       "fp8 per token: reference vs dense of the dequantized inputs", "fp8 rope: reference vs dense of the dequantized rope")
    + tuple(f"backward: reference vs dense: {g}" for g in ("dq", "dk", "dv", "dk_rope"))
)
#: ... with torch installed.
TORCH_CHECKS = ("torch CPU tensors through the reference",)
#: ... on a CUDA GPU.
GPU_CHECKS = (
    ("kernel: batch out", "kernel: cache_offsets and q_start_pos", "kernel: paged cache",
     "kernel: merge_states of two halves", "kernel: mla_prefill_chunked (chunk_size=24)",
     "kernel sm80: 1 x 1024 against the reference")
    + tuple(f"kernel: {m}" for m in MASK_NAMES)
    + tuple(f"kernel: plan.run, layer {i}" for i in range(3))
    + tuple(f"kernel: backward {g}" for g in ("dq", "dk", "dv", "dk_rope"))
)
#: ... on a Hopper GPU (the fp8 variants).
HOPPER_CHECKS = ("kernel: fp8 per token", "kernel: fp8 rope", "kernel sm90: 1 x 1024 against the reference")
#: ... with torch seeing a CUDA device.
TORCH_CUDA_CHECKS = ("kernel: torch CUDA tensors",)
#: ... with transformers installed and torch seeing a CUDA device.
TRANSFORMERS_CUDA_CHECKS = ("kernel: transformers DeepseekV3 logits vs eager",
                            "kernel: a model trained with mla_cupy learns the task")
#: Sections with a GPU part print one ``[no GPU]`` line each without a GPU: the batch, speed,
#: accuracy, masks, positions, paged cache, chunked prefill, fp8, plan and backward sections, the
#: torch section when torch is installed, the transformers one when transformers and torch are.
GPU_SECTIONS = 10
#: Figures a run shows: speed (measured: GPU only), accuracy by position, the mask patterns, the
#: fp8 error distribution, the training curves (GPU, torch and transformers only).
FIGURES_GPU, FIGURES_CPU = 5, 3


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _stdout(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _checks(nb) -> set:
    """Names of the CHECK lines a run printed (``CHECK <name> | relative error ...``)."""
    return _checks_in(_stdout(nb))


def _checks_in(text: str) -> set:
    return {line[len("CHECK "):].split(" | ")[0] for line in text.splitlines() if line.startswith("CHECK ")}


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def _expected(gpu: bool, hopper: bool, torch: bool, torch_cuda: bool, transformers: bool) -> set:
    want = set(CPU_CHECKS) | (set(TORCH_CHECKS) if torch else set())
    if gpu:
        want |= set(GPU_CHECKS) | (set(HOPPER_CHECKS) if hopper else set())
        want |= set(TORCH_CUDA_CHECKS) if torch_cuda else set()
        want |= set(TRANSFORMERS_CUDA_CHECKS) if torch_cuda and transformers else set()
    return want


def _runner():
    return load_script("examples/run_notebook.py", "run_notebook")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """What a person runs: ``jupyter nbconvert --to notebook --execute`` in examples/, the kernel
    importing this checkout's package."""
    for mod in ("nbformat", "nbconvert", "ipykernel", "matplotlib"):
        pytest.importorskip(mod)
    import nbformat

    out = tmp_path_factory.mktemp("nb") / "quickstart.ipynb"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                          "--ExecutePreprocessor.timeout=600", "--output", str(out), NB.name],
                         cwd=NB.parent, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]  # a cell that raises (a failed check) names itself here
    return nbformat.read(str(out), as_version=4)


def _check_run(checks: set, out: str) -> None:
    """The checks and skip lines a run on this machine must print."""
    gpu = gpu_count() > 0
    hopper = torch_cuda = False
    if gpu:
        import cupy

        hopper = cupy.cuda.Device().compute_capability == "90"
    if _installed("torch"):
        import torch

        torch_cuda = gpu and torch.cuda.is_available()
    with_hf = _installed("torch") and _installed("transformers")
    missing = _expected(gpu, hopper, _installed("torch"), torch_cuda, with_hf) - checks
    assert not missing, f"the notebook did not print these checks: {sorted(missing)}"
    notes = [line for line in out.splitlines() if line.startswith("[no GPU]")]
    want = 0 if gpu else GPU_SECTIONS + _installed("torch") + with_hf
    assert len(notes) == want, f"{len(notes)} sections said they have no GPU, not {want}: {notes}"
    assert "SKIPPED" not in out and "Traceback" not in out


def test_quickstart_runs_and_its_checks_hold(executed):
    _check_run(_checks(executed), _stdout(executed))
    assert _images(executed) == (FIGURES_GPU if gpu_count() else FIGURES_CPU), "every figure is shown inline"
    assert _runner().machine_paths(executed) == []


def test_quickstart_code_runs_without_jupyter():
    """The same run with the code cells executed in this process (machines without a Jupyter
    kernel: the GPU machine runs the notebook this way)."""
    pytest.importorskip("matplotlib")
    out = _runner().execute_plain(NB)  # a cell that raises fails here, naming the cell
    _check_run(_checks_in(out), out)


def test_stored_notebook_has_the_outputs_of_a_gpu_run_or_none():
    """Stored outputs are those of one GPU run of the current notebook, top to bottom, every check
    of a Hopper GPU with torch and transformers printed, no machine path; or there are none at all
    (never a CPU run's, never stale ones: a GPU run of ``examples/run_notebook.py`` stores them)."""
    nbformat = pytest.importorskip("nbformat")
    assert NB.stat().st_size < 1 << 20, "keep the stored notebook under 1 MB"
    nb = nbformat.read(NB, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if all(c.execution_count is None and not c.outputs for c in code):
        return  # stripped: nothing stored to be stale
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "every cell run in order"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    missing = _expected(True, True, True, True, True) - _checks(nb)
    assert not missing, f"the stored outputs lack these checks of a GPU run: {sorted(missing)}"
    assert "[no GPU]" not in _stdout(nb)
    assert _images(nb) == FIGURES_GPU, "the stored notebook shows its figures"
    assert _runner().machine_paths(nb) == [], "the stored outputs hold paths of a machine"


def test_machine_paths_are_found():
    from types import SimpleNamespace

    nb = SimpleNamespace(cells=[{"outputs": [{"text": "/opt/torch/.venv/lib/python3.12/site-packages/tqdm/auto.py:21: W"},
                                             {"data": {"text/plain": "C:\\Users\\me\\x.py", "image/png": "/tmp/x"}},
                                             {"text": "see docs/contract.md and ./gpu-logs/x (relative)"}]}])
    assert _runner().machine_paths(nb) == ["/opt/torch/.venv/lib/python3.12/site-packages/tqdm/auto.py:21:",
                                           "C:\\Users\\me\\x.py"]
