"""HumanEval execution and scoring: pass@k estimator, data loading, and the sandbox's containment."""
import importlib.util
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; fail rather than reach out
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `eval/` is a plain directory at the repo root, not an installed package
    sys.path.insert(0, str(ROOT))

from eval.humaneval_data import load_pass_at_k_metric, load_problems, truncate_completion  # noqa: E402
from eval.sandbox import run_check, run_checks  # noqa: E402

CANONICAL_IDS = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/7", "HumanEval/12"]
TIMEOUT = 3.0


def _estimator():
    """estimate_pass_at_k straight from the metric script (evaluate copies it elsewhere to import it)."""
    path = ROOT / "eval" / "metrics" / "code_pass_at_k" / "code_pass_at_k.py"
    spec = importlib.util.spec_from_file_location("code_pass_at_k_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.estimate_pass_at_k


def _brute_pass_at_k(n, c, k):
    """Fraction of k-subsets of n samples (the first c correct) containing a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


# ---------------------------------------------------------------- pass@k


def test_estimator_matches_brute_force():
    estimate = _estimator()
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert estimate(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


@pytest.fixture(scope="module")
def metric():
    return load_pass_at_k_metric()


def test_metric_averages_over_problems(metric):
    counts = [(5, 0), (5, 2), (6, 6), (7, 3)]
    out = metric.compute(num_samples=[n for n, _ in counts], num_correct=[c for _, c in counts], k=[1, 2, 5])
    assert set(out) == {"pass@1", "pass@2", "pass@5"}
    for k in (1, 2, 5):
        expected = sum(_brute_pass_at_k(n, c, k) for n, c in counts) / len(counts)
        assert out[f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert out["pass@1"] == pytest.approx(sum(c / n for n, c in counts) / len(counts))


def test_metric_loads_by_directory_path(monkeypatch):
    import evaluate

    monkeypatch.chdir(ROOT)
    m = evaluate.load("eval/metrics/code_pass_at_k")
    assert m.compute(num_samples=[2, 2], num_correct=[1, 2], k=[1, 2]) == {"pass@1": 0.75, "pass@2": 1.0}


@pytest.mark.parametrize("kwargs", [
    dict(num_samples=[3, 10], num_correct=[1, 2], k=[5]),  # k > n for the first problem
    dict(num_samples=[3], num_correct=[4], k=[1]),  # c > n
    dict(num_samples=[3], num_correct=[1], k=[0]),
])
def test_metric_rejects_bad_counts(metric, kwargs):
    with pytest.raises(ValueError):
        metric.compute(**kwargs)


# ---------------------------------------------------------------- data


@pytest.fixture(scope="module")
def problems():
    return {p["task_id"]: p for p in load_problems(problems=CANONICAL_IDS)}


def test_load_problems_selection_and_limit(problems):
    assert list(problems) == CANONICAL_IDS
    assert set(problems["HumanEval/0"]) >= {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
    assert [p["task_id"] for p in load_problems(problems=[5, "HumanEval/1"])] == ["HumanEval/5", "HumanEval/1"]
    assert [p["task_id"] for p in load_problems(limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert len(load_problems()) == 164


def test_load_problems_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_problems(path=tmp_path / "missing.jsonl.gz")
    with pytest.raises(ValueError, match="HumanEval/999"):
        load_problems(problems=["HumanEval/0", "HumanEval/999"])
    with pytest.raises(ValueError, match="164"):
        load_problems(problems=[164])


def test_truncate_completion():
    body = "    return x + 1\n"
    assert truncate_completion(body) == body
    for stop in ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]:
        assert truncate_completion(body + stop + "junk\n") == body
    # the earliest stop sequence wins, whatever its position in the list
    assert truncate_completion(body + "\n# note\ndef g():\n    pass\n") == body
    assert truncate_completion("\ndef f(): pass") == ""


# ---------------------------------------------------------------- sandbox

# Looks for the token in argv and the environment, writes a PASS line with it (or a guess) to every
# pipe it holds, and exits 0 before check() runs. It fails only because the token is not visible to it:
# see the negative control test_forger_passes_if_the_token_leaks.
FORGER = """\
    return False
import os, re, stat, sys
tokens = [v for v in [*sys.argv, *os.environ.values()] if re.fullmatch('[0-9a-f]{32}', v)]
for fd in range(3, 256):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, ('PASS ' + (tokens[0] if tokens else 'guess') + '\\n').encode())
    except OSError:
        pass
print('PASS'); sys.stdout.flush()
os._exit(0)
"""

# Hostile bodies for HumanEval/0 (has_close_elements); each must fail with a reason containing the text.
HOSTILE = {
    "infinite loop": ("    while True:\n        pass\n", "timed out"),
    "os._exit(0)": ("    import os\n    os._exit(0)\n", "exited before check() completed"),
    "fork bomb": ("    import os\n    while True:\n        os.fork()\n", "TypeError"),
    "posix.fork": ("    import posix\n    posix.fork()\n", "TypeError"),
    "subprocess": ("    import subprocess\n    subprocess.Popen(['sleep', '60'])\n", "TypeError"),
    "kill harness": ("    import os, signal\n    os.kill(os.getppid(), signal.SIGINT)\n", "TypeError"),
    "huge allocation": ("    x = bytearray(16 * 1024 ** 3)\n    return bool(x)\n", "MemoryError"),
    "write files": ("    open('pwned.txt', 'w').write('x')\n    open('big.bin', 'wb').write(b'0' * (8 << 20))\n"
                    "    return True\n", "File too large"),
    "import error": ("    return False\nimport nonexistent_module_xyz\n", "ModuleNotFoundError"),
    "sys.exit(0)": ("    return False\nimport sys\nsys.exit(0)\n", "SystemExit"),
    "exit() builtin": ("    return False\nexit(0)\n", "TypeError"),
    "syntax error": ("    return (\n", "SyntaxError"),
    "prints sentinel": ("    print('PASS'); print('passed')\n    return True\n", "AssertionError"),
    "forged sentinel": (FORGER, "invalid result report"),
}


def test_canonical_pass_wrong_and_hostile_fail(problems, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the harness's cwd: must stay empty
    workdirs = []  # every sandbox working directory, to check that each was removed
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: workdirs.append(mkdtemp(**kw)) or workdirs[-1])
    target = problems["HumanEval/0"]
    items = [(p, p["canonical_solution"]) for p in problems.values()]
    items += [(p, "    return None\n") for p in problems.values()]
    items += [(target, body) for body, _ in HOSTILE.values()]

    results = run_checks(items, workers=2, timeout=TIMEOUT, progress=False)

    n = len(problems)
    for (p, _), r in zip(items[:n], results[:n]):
        assert r == {"passed": True, "result": "passed"}, p["task_id"]
    for (p, _), r in zip(items[n:2 * n], results[n:2 * n]):
        assert not r["passed"], p["task_id"]
    for (name, (_, reason)), r in zip(HOSTILE.items(), results[2 * n:]):
        assert not r["passed"], name
        assert reason in r["result"], (name, r)
    assert list(tmp_path.iterdir()) == []
    assert len(workdirs) == len(items) and not any(os.path.exists(d) for d in workdirs)
    # still a working harness: a correct sample run afterwards passes
    assert run_check(target, target["canonical_solution"], timeout=TIMEOUT)["passed"]


def test_forger_passes_if_the_token_leaks(problems, monkeypatch):
    """Negative control: with the token in the child's environment the forger above scores a pass."""
    import eval.sandbox as sandbox

    token = "ab" * 16
    child_env = sandbox._child_env
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda nbytes: token)
    monkeypatch.setattr(sandbox, "_child_env", lambda workdir: {**child_env(workdir), "LEAK": token})
    assert run_check(problems["HumanEval/0"], FORGER, timeout=TIMEOUT)["passed"]


def test_gradual_memory_growth_is_contained(problems):
    body = "    x = []\n    while True:\n        x.append(' ' * 10 ** 6)\n"
    r = run_check(problems["HumanEval/0"], body, timeout=TIMEOUT, memory_mb=128)
    assert not r["passed"] and "MemoryError" in r["result"], r


def test_stray_children_are_killed(problems):
    """Even if the guard were bypassed, the process group dies with the check."""
    body = ("    return False\n"
            "import sys\n"
            "sys.modules.pop('_posixsubprocess', None)\n"
            "import importlib, subprocess\n"
            "importlib.reload(subprocess)\n"  # fresh module: undoes the nulled Popen
            f"subprocess.Popen(['sleep', '{SLEEP_ARG}'])\n")
    r = run_check(problems["HumanEval/0"], body, timeout=TIMEOUT)
    # AssertionError: the sleeper was started and check() then failed; EAGAIN: RLIMIT_NPROC stopped it
    assert not r["passed"] and ("AssertionError" in r["result"] or "temporarily unavailable" in r["result"]), r
    # no `sleep` of ours left running (start_new_session + killpg); SIGKILL is asynchronous, so poll
    deadline = time.monotonic() + 5
    while _our_sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _our_sleepers() == [], r


SLEEP_ARG = "987.654"  # distinctive, so no unrelated process matches


def _our_sleepers():
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.joinpath("cmdline").read_bytes() == f"sleep\0{SLEEP_ARG}\0".encode():
                found.append(proc.name)
        except OSError:
            pass  # exited meanwhile
    return found
