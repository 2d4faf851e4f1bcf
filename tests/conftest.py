"""Test setup: 8 simulated CPU devices (set before jax is imported) and paths to the repository's data."""

import os
import tempfile

# LLVM's optimisation level 0 for the CPU programs the test processes compile (and the subprocesses of
# tests/train_helpers.py's train_env, which keeps it and drops the device count): compiling dominates the
# in-process tests, and at level 0 their CPU time fell by 20-40 % (the 2x2x2-mesh training step 43.6 -> 26.1
# s, the sampled continuous-vs-static equality 46.3 -> 32.3 s) for slower code where little runs; the
# subprocesses' short runs of tiny models gain too (train_env says how much). HLO passes, and so fusion,
# layouts, memory and every compiled fact the tests read, are the same at any level; reductions keep their
# order.
# One LLVM module a program, not split for parallel code generation, which on two cores busy with two workers
# only costs (tests/test_sampling_continuous.py: CPU 82 -> 76 s). The subprocesses inherit both. (XLA:CPU's
# fusion emitters can no longer be switched off: JAX 0.12's XLA has no --xla_cpu_use_fusion_emitters, and an
# unknown flag aborts every process.)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    " --xla_cpu_parallel_codegen_split_count=1 --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the whole run, read and written by both xdist workers and every
# trainer subprocess (they inherit the variable): the suite compiles many identical programs (each run's
# StepPrograms in a dozen files, the demo in a dozen subprocesses). The subprocesses of
# train_helpers.train_env write every program, the test processes those that compile in 0.3 s or more
# (pytest_configure below). A size limit turns on JAX's file lock around each read and write of the cache,
# so that no process reads an entry that another is writing (the xdist workers, the trainer subprocesses
# and the processes of a multi-process run use it at once).
# The run's own folder (named after the process that made it: pytest's, whose xdist workers and subprocesses
# inherit the variable) is removed when that process ends (pytest_unconfigure); a folder the caller named is kept.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"pacs_jax_tests_jit_cache_{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(32 << 30))

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / "data"


def pytest_configure(config):
    """The test processes write the programs that took 0.3 s or more to compile to the compilation cache,
    so that another file's identical program is read, not compiled (four in-process training files, one
    process: CPU 216 -> 183 s). They once only read it: a worker crashed serializing a program
    (``Executable.serialize``) at the kernel's mappings limit, which ``_free_compiled_programs`` below now
    keeps every worker far from."""
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


def pytest_unconfigure(config):
    """The run's compilation cache folder is removed by the process that named it (tens of megabytes a run
    were left in the temporary folder)."""
    if _OWN_CACHE:
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test file, JAX's caches are cleared, freeing the file's compiled programs: each holds
    memory mappings of its machine code, and an xdist worker that kept every program of its files
    reached the kernel's limit of 65,530 mappings (vm.max_map_count) and crashed in the next compile
    (a segmentation fault, in CI and here; 10,900 mappings after 4.5 minutes of tests in one process)."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The repository's data/ folder: the real datasets (data/README.md lists them and their licenses).

    They ship with the repository, so a missing folder is a broken checkout: the test fails."""
    if not DATA.is_dir():
        pytest.fail(f"the repository's datasets are missing: no folder {DATA} (see data/README.md)",
                    pytrace=False)
    return DATA


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> pathlib.Path:
    """data/tokenizers/qwen3 in the repository: the real Qwen tokenizer files (vocab.json, merges.txt,
    tokenizer_config.json). A missing folder or file fails the test."""
    path = DATA / "tokenizers" / "qwen3"
    missing = [name for name in ("vocab.json", "merges.txt", "tokenizer_config.json")
               if not (path / name).is_file()]
    if missing:
        pytest.fail(f"the Qwen tokenizer is missing from the repository: {path} lacks {', '.join(missing)} "
                    "(see data/README.md)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def small_tokenizer_dir(qwen_tokenizer_dir, tmp_path_factory) -> pathlib.Path:
    """The real Qwen tokenizer cut to 4,096 entries (tests/train_helpers.py's write_small_tokenizer): its
    byte tokens, first merges and every added token (chat template, <|im_end|>, <|endoftext|>), for the
    in-process and subprocess trainings and evaluations of a tiny model whose tests are not about the
    vocabulary (a model built with vocab_size 0 takes the tokenizer's 4,096). The real one stays in the
    tests of the tokenizer, the HF round trips and the README's paper commands."""
    from train_helpers import write_small_tokenizer

    return write_small_tokenizer(qwen_tokenizer_dir, tmp_path_factory.mktemp("small_qwen_tokenizer"))


def pytest_collection_modifyitems(config, items):
    """The files with the longest `slow` tests first, in collection order otherwise (and a file's tests
    in its own order): with --no-loadscope-reorder (pyproject.toml) the two xdist workers start the
    longest files first and the short ones fill in, rather than a long file starting last. A `slow`
    test counts ``seconds`` (its marker's estimate on 2 cores, module fixtures included) or 30."""
    weight: dict = {}
    for item in items:
        marker = item.get_closest_marker("slow")
        weight[item.path] = weight.get(item.path, 0) + (marker.kwargs.get("seconds", 30) if marker else 0)
    first = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-weight[item.path], first[item.path]))
