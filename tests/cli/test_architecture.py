"""The layout's promises: dependencies point one way, the demo stays out of the core, benchmarks
and scripts name only what the project has, every setting is documented and validated at load
time, plug-ins take anyone's `module:function`, and the shared entry point takes options and
overrides in any order."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from yatt_mm.config import ConfigError, load, undocumented, unranged
from yatt_mm.rl.config import RLConfig
from yatt_mm.sft.config import SFTConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ["policy.model=tiny:policy", "reward.judges=[]"]  # the demo config without its warm starts


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package, forbidden", [
    ("yatt_mm/rl", "yatt_mm.demo"), ("yatt_mm/reward", "yatt_mm.demo"), ("yatt_mm/engines", "yatt_mm.demo"),
    ("yatt_mm/sft", "yatt_mm.demo"), ("models", "yatt_mm"), ("dataio", "yatt_mm"),
    ("yatt_mm/engines", "yatt_mm.reward"), ("yatt_mm/engines", "yatt_mm.rl"),  # engines serve rollout and judges alike
])
def test_dependencies_point_one_way(package, forbidden):
    bad = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n == forbidden or n.startswith(forbidden + "."))
           for p in (ROOT / package).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def _module_graph(packages=("yatt_mm", "models", "dataio")) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports, at any level (function-local and
    TYPE_CHECKING imports count: a circle hidden in a function is still a circle); relative
    imports resolved, `from pkg import mod` counted as an import of pkg.mod."""
    files = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:  # the innermost of our modules that `name` names
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                names += [f"{base}.{a.name}" for a in node.names]
        graph[module] = {m for m in map(known, names) if m and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # a path back to the start through the component (breadth first: shortest)
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & component):
                if w == start:
                    cycles.append(paths[v] + [start])
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(cycles)


def test_no_import_circles():
    """A circle means two layers that cannot be understood, tested or reused one without the
    other: break it by moving what both need to the lower layer, not with a function-local import."""
    cycles = _cycles(_module_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


MAX_LINES = 650  # a file past it holds more than one job: split it by job, as rl/checkpoint*.py


def test_no_file_is_over_650_lines():
    """Every file of the project (code, tests, docs, configs; the generated config reference
    included) reads in one sitting."""
    folders = ("yatt_mm", "dataio", "models", "configs", "tests", "docs", "benchmarks", "scripts", ".ci")
    paths = [p for d in folders for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    paths += [*ROOT.glob("*.md"), ROOT / "pyproject.toml", ROOT / "Makefile"]
    paths = [p for p in paths if p.suffix not in (".png", ".json", ".jsonl", ".pyc")]  # data, not reading
    assert len(paths) > 300
    lines = {str(p.relative_to(ROOT)): len(p.read_text(errors="replace").splitlines()) for p in paths}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines, split by job: {long}"


def test_the_circle_check_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d", "f"}, "f": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]


# Modules outside the model families that may name one: the registry's list of family modules,
# the GPU check, which builds a Qwen2-VL checkpoint by name (transformers' classes), and the
# benchmark of one family's vision tower (Qwen2.5-VL's windows against its masked predecessor).
# the GPU check builds one 2B-width Qwen2-VL and one Qwen3-VL at 8B widths by name
FAMILY_IMPORTS_ALLOWED = {"models/family.py", "scripts/gpu_stages/build.py", "scripts/gpu_stages/parity.py",
                          "benchmarks/bench_vision_tower.py"}


def test_only_the_families_import_a_family():
    """models/family.py's layout: trainer, parity, sync, export, plan, data and tiny models ask
    the family found from model_type, so no module outside models/<family>/ imports one."""
    families = sorted(p.name for p in (ROOT / "models").iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert "qwen2vl" in families  # every folder under models/ is a family's (shared code sits beside them)
    bad = {}
    for package in ("yatt_mm", "models", "dataio", "scripts", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if str(rel) in FAMILY_IMPORTS_ALLOWED or (rel.parts[0] == "models" and rel.parts[1] in families):
                continue
            names = sorted(n for n in _imports(path) for f in families if n == f"models.{f}" or
                           n.startswith(f"models.{f}.") or (n == "models" and f"import {f}" in path.read_text()))
            if names:
                bad[str(rel)] = names
    assert not bad, f"ask models.family instead: {bad}"


def _missing_project_names(path: Path) -> list[str]:
    """The project names `path` imports (`from models.x import y`, also inside functions) or
    reads off an imported project module (`import models.x as m` ... `m.y`) that do not exist."""
    import importlib

    project = ("models", "yatt_mm", "dataio")
    tree = ast.parse(path.read_text())
    aliases, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in project:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name: a.name for a in node.names if a.name.split(".")[0] in project}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = importlib.import_module(aliases[node.value.id])
            if not hasattr(module, node.attr):
                missing.append(f"{path.name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return missing


def test_benchmarks_and_scripts_name_what_the_project_has(tmp_path):
    """Scripts run by hand, not in CI, and benchmarks run in CI at their smoke size only
    (tests/benchmarks), which leaves some of their paths unrun (other --kind choices); both import
    the project inside functions: a renamed or moved name shows only when someone runs them
    (bench_long_context.py patched `models.trainer.context_plan` long after it had gone). Every
    such name must still exist."""
    paths = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").rglob("*.py")])  # the GPU stages too
    assert len(paths) > 20
    missing = [m for path in paths for m in _missing_project_names(path)]
    assert not missing, missing
    # the check finds the old rot: the plan patched on a module that does not hold it
    probe = tmp_path / "bench_long_context.py"
    probe.write_text((ROOT / "benchmarks" / "bench_long_context.py").read_text().replace(
        "import models.context as context_mod", "import models.trainer as context_mod"))
    assert {m.split(" ")[1] for m in _missing_project_names(probe)} == {"models.trainer.plan"}


def test_the_family_is_found_from_config_json(tmp_path):
    """Cheap (no model is built): the family of a directory comes from its config.json's
    model_type, and another model_type is an error that names the supported families."""
    import json

    from models.family import family_for_dir, family_for_model_type, families, supported_model_types

    for model_type in ("qwen2_vl", "qwen2_5_vl"):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        family = family_for_dir(tmp_path / model_type)
        assert model_type in family.model_types and family is family_for_model_type(model_type)
    assert {"qwen2_vl", "qwen2_5_vl"} <= set(supported_model_types())
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError) as e:
        family_for_dir(tmp_path / "llava")
    assert "'llava' is not supported" in str(e.value)
    for family in families():
        assert family.name in str(e.value) and all(t in str(e.value) for t in family.model_types)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        family_for_dir(tmp_path)


def test_importing_the_family_registry_is_cheap():
    """Registering the families imports none of torch, transformers, Megatron (the CLI's parser
    lists the tiny kinds)."""
    code = ("import sys; from models.family import families, tiny_kinds; families(); tiny_kinds(); "
            "print(sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("root", [RLConfig, SFTConfig])
def test_every_setting_has_a_doc(root):
    assert undocumented(root) == []


def test_help_config_lists_every_setting_with_its_doc():
    # the launcher imports the config alone: listing, loading or refusing a config imports neither
    # Megatron nor vLLM (each takes seconds on two cores; the ranks import them)
    script = ("import sys; from yatt_mm.cli import main; rc = main(['rl', '--help-config']); "
              "heavy = sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('megatron', 'vllm')}); "
              "print('heavy imports:', heavy, file=sys.stderr); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "heavy imports: []" in out.stderr, out.stderr[-2000:]
    assert "run.micro_batch_tokens (int, >= 1, default 4096): per micro-batch: rows x longest row" in out.stdout
    assert "run.placement (str, 'full' | 'partial' | 'disaggregated', default 'full'): partial:" in out.stdout
    assert "rollout.sampling.top_p (float, in (0, 1], default 1.0): nucleus sampling" in out.stdout
    assert "reward.judges (list of sections): GenRM judges" in out.stdout
    assert "dynamic_sampling.filter (str, default 'reward_spread'):" in out.stdout
    assert "reward.judges[].judge.backend (str, default 'inprocess'):" in out.stdout


@pytest.mark.parametrize("override, message", [
    ("run.placement=partial", "served by vLLM servers"),
    ("dynamic_sampling.filter=no_such_filter", "unknown rollout filter 'no_such_filter'; registered: reward_spread"),
    ("reward.functions=[{name: exactmatch}]", "reward.functions\\[0\\]: unknown reward function 'exactmatch'"),
    ("rollout.prompts_per_step=0", "rollout.prompts_per_step must be >= 1, got 0"),
    ("reward.judges=[{judge: {backend: grpc}}]", "unknown judge backend 'grpc'"),
    # vLLM takes its GPU share at start, and a rank's engines start together: they must fit
    ("rollout.engine.gpu_memory_utilization=0.8", "shares on one GPU add up to 1.10 > 0.95 \\(rollout.engine 0.8, "
                                                  "judge genrm 0.3\\): lower a gpu_memory_utilization"),
    ("rollout.engine.tensor_parallel_size=2", "tensor_parallel_size=2: an engine spans 1 rank or the ranks of one DP"),
    ("rollout.engine.gpu_memory_utilization=1.5", "rollout.engine.gpu_memory_utilization must be in \\(0, 1\\), got 1.5"),
    # Megatron fuses q/k/v (and gate/up) into one layer with one adapter
    (("policy.lora.rank=8", "policy.lora.target_modules=[q_proj,o_proj]"),
     "policy.lora: target_modules has \\['q_proj'\\] without \\['k_proj', 'v_proj'\\]: Megatron fuses"),
    ("policy.lora.target_modules=[qkv]", "policy.lora: target_modules: \\['qkv'\\] are not projections of the language"),
    (("policy.lora.rank=8", "policy.lora.target_modules=[in_proj_qkv,out_proj]"),
     "policy.lora: target_modules has \\['in_proj_qkv'\\] without \\['in_proj_a', 'in_proj_b', 'in_proj_z'\\]"),
    ("sync.lora=adapter", "sync.lora=adapter sends the LoRA adapter alone, but policy.lora.rank is 0"),
    (("policy.lora.rank=1024", "sync.lora=adapter"), "vLLM serves adapters of rank <= 512"),
    ("policy.lora.vision_tower=true", "policy.lora.vision_tower=true puts adapters on the vision tower, but "
                                      "policy.lora.rank is 0"),
    (("policy.lora.rank=8", "policy.lora.vision_tower=true", "policy.freeze_vision=true"),
     "policy.freeze_vision=true freezes the vision tower, and policy.lora.vision_tower=true trains adapters on it"),
])
def test_bad_values_fail_at_load_naming_the_setting(override, message):
    with pytest.raises(ConfigError, match=message):
        load(RLConfig, ROOT / "configs/tiny_demo.yaml", [override] if isinstance(override, str) else list(override))


@pytest.mark.parametrize("root", [RLConfig, SFTConfig])
def test_every_numeric_setting_has_a_range(root):
    assert unranged(root) == []


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_file_loads(name):
    load(SFTConfig if "sft" in name else RLConfig, ROOT / "configs" / name)


RL, SFT = (RLConfig, "tiny_demo.yaml"), (SFTConfig, "tiny_sft.yaml")


@pytest.mark.parametrize("root, override, error", [
    (RL, "rollout.sampling.n=0", "rollout.sampling.n must be >= 1, got 0"),
    (RL, "rollout.sampling.max_tokens=-1", "rollout.sampling.max_tokens must be >= 1, got -1"),
    (RL, "rollout.sampling.temperature=-2", "rollout.sampling.temperature must be in [0, 2], got -2.0"),
    (RL, "rollout.sampling.top_p=1.5", "rollout.sampling.top_p must be in (0, 1], got 1.5"),
    (RL, "rollout.sampling.seed=-1", "rollout.sampling.seed must be >= 0, got -1"),
    (RL, "rollout.engine.max_model_len=0", "rollout.engine.max_model_len must be >= 1, got 0"),
    (RL, "rollout.engine.limit_mm_per_prompt={image: -1}", "rollout.engine.limit_mm_per_prompt must be >= 0, got {'image': -1}"),
    (RL, "rollout.engine.max_num_seqs=0", "rollout.engine.max_num_seqs must be >= 1, got 0"),
    (RL, "policy.trainer.lr=-1", "policy.trainer.lr must be > 0, got -1.0"),
    (RL, "policy.trainer.adam_beta2=1", "policy.trainer.adam_beta2 must be in [0, 1), got 1.0"),
    (RL, "policy.trainer.clip_grad=-1", "policy.trainer.clip_grad must be >= 0, got -1.0"),
    (RL, "policy.trainer.pipeline_parallel=0", "policy.trainer.pipeline_parallel must be >= 1, got 0"),
    (RL, "run.steps=0", "run.steps must be >= 1, got 0"),
    (RL, "run.checkpoint_every=-1", "run.checkpoint_every must be >= 0, got -1"),
    (RL, "run.patch_weight=-0.5", "run.patch_weight must be >= 0, got -0.5"),
    (RL, "data.workers=-1", "data.workers must be >= 0, got -1"),
    (RL, "data.shuffle_buffer=0", "data.shuffle_buffer must be >= 1, got 0"),
    (RL, "data.media.video_fps=0", "data.media.video_fps must be > 0, got 0.0"),
    (RL, "data.media.factor=-1", "data.media.factor must be >= 0, got -1"),
    (RL, "algorithm.clip_low=1.5", "algorithm.clip_low must be in [0, 1], got 1.5"),
    (RL, "algorithm.kl_coef=-0.1", "algorithm.kl_coef must be >= 0, got -0.1"),
    (RL, "algorithm.epochs=0", "algorithm.epochs must be >= 1, got 0"),
    (RL, "dynamic_sampling.ema=0", "dynamic_sampling.ema must be in (0, 1], got 0.0"),
    (RL, "dynamic_sampling.max_buffer=-1", "dynamic_sampling.max_buffer must be >= 0, got -1"),
    (RL, "sync.bucket_mb=0", "sync.bucket_mb must be > 0, got 0.0"),
    (RL, "policy.lora.rank=-1", "policy.lora.rank must be >= 0, got -1"),
    (RL, "policy.lora.dropout=1", "policy.lora.dropout must be in [0, 1), got 1.0"),
    (RL, "eval.every=-1", "eval.every must be >= 0, got -1"),
    (RL, "eval.max_tokens=0", "eval.max_tokens must be >= 1, got 0"),
    (RL, "split.judge_share=1", "split.judge_share must be in (0, 1), got 1.0"),
    (RL, "split.cores=-1", "split.cores must be >= 0, got -1"),
    (RL, "cluster.nodes=-1", "cluster.nodes must be >= 0, got -1"),
    (RL, "cluster.gpu_memory_gib=-80", "cluster.gpu_memory_gib must be >= 0, got -80.0"),
    (RL, "reward.functions=[{weight: .nan}]", "reward.functions[0].weight must be >= 0, got nan"),
    (RL, "reward.judges=[{judge: {votes: 0}}]", "reward.judges[0].judge.votes must be >= 1, got 0"),
    (RL, "reward.judges=[{judge: {port: 70000}}]", "reward.judges[0].judge.port must be in [0, 65535], got 70000"),
    (RL, "reward.judges=[{judge: {timeout_s: 0}}]", "reward.judges[0].judge.timeout_s must be > 0, got 0.0"),
    (RL, "reward.judges=[{judge: {score_range: [1, 0]}}]", "reward.judges[0].judge: score_range must be [lo, hi] with lo < hi"),
    (RL, "data.worker_kind=fork", "data.worker_kind: 'fork' is not one of 'thread', 'process'"),
    (RL, "run.placement=half", "run.placement: 'half' is not one of 'full', 'partial'"),
    (SFT, "steps=0", "steps must be >= 1, got 0"),
    (SFT, "batch_size=0", "batch_size must be >= 1, got 0"),
    (SFT, "warmup_steps=-1", "warmup_steps must be >= 0, got -1"),
    (SFT, "trainer.lr=0", "trainer.lr must be > 0, got 0.0"),
    (SFT, "eval.holdout_fraction=1", "eval.holdout_fraction must be in [0, 1), got 1.0"),
    (SFT, "eval.stop_at=2", "eval.stop_at must be in [0, 1], got 2.0"),
    (SFT, "data.prefetch=-1", "data.prefetch must be >= 0, got -1"),
])
def test_out_of_range_settings_fail_at_load_naming_the_setting(root, override, error):
    cls, config = root
    with pytest.raises(ConfigError) as e:
        load(cls, ROOT / "configs" / config, [override])
    assert str(e.value).startswith(error)


def test_a_bad_setting_stops_the_launcher_before_anything_starts():
    out = subprocess.run([sys.executable, "-m", "yatt_mm.cli", "rl", "--config", "configs/tiny_demo.yaml", "--nproc", "2",
                          "rollout.sampling.n=0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "yatt-mm rl: config error: rollout.sampling.n must be >= 1, got 0"
    # no warm start built, no torchrun, no rank: nothing on stdout, and no rank's lines on stderr
    assert out.stdout == "" and not re.search(r"torchrun|torch\.distributed|\brank\b|warm", out.stderr, re.IGNORECASE)


def test_the_launcher_takes_a_recipes_cluster_and_notes_a_launch_of_another_shape(tmp_path, capsys):
    """`yatt-mm rl` loads a recipe with its cluster section; launched on another shape than it states
    (2 nodes x 8 GPUs for the 30B-A3B recipe), it says so once, naming the plan for this shape, and
    goes on (here to the model directory, missing, where it stops before any rank starts)."""
    import yatt_mm.launch as launch
    from dataio.synth import write_shards

    write_shards(str(tmp_path / "shards"), images=2, videos=0, samples_per_shard=2)  # the recipe's data is elsewhere
    recipe = "configs/qwen3vl_30b_a3b_16gpu.yaml"
    missing = f"policy.model={tmp_path / 'no-model'}"
    here = [f"data.shards=[{tmp_path / 'shards'}]", f"eval.shards=[{tmp_path / 'shards'}]"]
    assert launch.run_command("yatt-mm rl", RLConfig, "m", lambda cfg: 0, ["--config", recipe, "--nproc", "8",
                                                                           missing, *here]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("yatt-mm rl: note: the config is written for cluster.nodes=2; this launch has --nnodes 1: its "
                      f"memory plan is for the stated cluster (plan this one: yatt-mm plan --config {recipe} --nodes 1)")
    assert len(err) == 2 and "no-model" in err[1]
    for shape in (["--nproc", "8", "--nnodes", "2"], ["--nproc", "16", "cluster.nodes=0", "cluster.gpus_per_node=0"]):
        assert launch.run_command("yatt-mm rl", RLConfig, "m", lambda cfg: 0,
                                  ["--config", recipe, *shape, missing, *here]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "note" not in err[0], (shape, err)  # the stated shape, or none stated: no note


def _config_reference():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts/gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_up_to_date():
    gen = _config_reference()
    fresh = gen.render().splitlines()
    committed = gen.PATH.read_text().splitlines() if gen.PATH.is_file() else []
    if committed != fresh:
        first = next((i for i, (a, b) in enumerate(zip(committed, fresh)) if a != b), min(len(committed), len(fresh)))
        pytest.fail(f"docs/reference/config.md is stale (from line {first + 1}: "
                    f"{(fresh[first:first + 1] or ['its end'])[0][:120]!r}): run {gen.COMMAND}")


def test_help_config_markdown_prints_the_reference_table(capsys):
    import yatt_mm.launch as launch

    assert launch.run_command("yatt-mm sft", SFTConfig, "m", lambda cfg: 1, ["--help-config", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## `yatt-mm sft`\n\n| Setting | Type | Default | Allowed | Description |\n")
    assert "| `trainer.lr` | float | `0.001` | > 0 | Adam learning rate |" in out  # SFT's default, not the trainer's
    assert out.strip() in (ROOT / "docs/reference/config.md").read_text()


PLUGINS = '''
from yatt_mm.sft.examples import Example

def half(text, answer, metadata):
    return 0.5

def keep_all(group):
    return True

class Judge:
    def __init__(self, cfg):
        self.cfg = cfg

def make_judge(cfg):
    return Judge(cfg)

def build(sample, rng):
    return Example(sample.key, [], [], [], "x")
'''


def test_plugins_take_module_function(tmp_path, monkeypatch):
    from yatt_mm.reward.judges import build_judges
    from yatt_mm.rl.dynamic_sampling import DynamicSampler
    from yatt_mm.sft.examples import get_builder

    (tmp_path / "my_plugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load(RLConfig, ROOT / "configs/tiny_demo.yaml", [
        "reward.functions=[{name: 'my_plugins:half'}]", "dynamic_sampling.filter=my_plugins:keep_all",
        "reward.judges=[{judge: {name: mine, backend: 'my_plugins:make_judge'}}]"])
    from yatt_mm.reward.rules import get_rule

    assert get_rule(cfg.reward.functions[0].name)("a", "b", {}) == 0.5
    assert DynamicSampler(cfg.dynamic_sampling).is_valid(object())
    judges = build_judges(cfg.reward.judges)
    assert judges.names == ["mine"] and type(judges.entries[0][1]).__name__ == "Judge" and judges.engines() == []
    build = get_builder("my_plugins:build")
    assert build.eval_builder is build
    with pytest.raises(ValueError, match="cannot be loaded"):
        get_builder("my_plugins:nothing")


def test_options_and_overrides_in_any_order_and_the_launcher_resolves_models(tmp_path, monkeypatch, demo_shards):
    import yatt_mm.launch as launch

    seen = {}
    argv = ["run.steps=3", "--config", "configs/tiny_demo.yaml", *TINY, *demo_shards, "rollout.sampling.n=2"]
    assert launch.run_command("t", RLConfig, "m", lambda cfg: seen.setdefault("cfg", cfg) and 0, argv) == 0
    cfg = seen["cfg"]
    assert cfg.run.steps == 3 and cfg.rollout.sampling.n == 2
    assert (Path(cfg.policy.model) / "config.json").is_file()  # tiny:policy became its directory

    launched = {}
    monkeypatch.setattr(launch, "relaunch",
                        lambda module, n, args, nodes: launched.update(module=module, n=n, args=args, nodes=nodes) or 0)
    argv = ["--config", "configs/tiny_demo.yaml", "run.steps=4", "--nproc", "2", *TINY, *demo_shards,
            f"run.run_dir={tmp_path}"]
    assert launch.run_command("t", RLConfig, "yatt_mm.rl.train", lambda cfg: 1, argv) == 0
    assert launched["module"] == "yatt_mm.rl.train" and launched["n"] == 2
    assert launched["args"] == ["--config", str(tmp_path / "config.yaml")]
    again = load(RLConfig, tmp_path / "config.yaml")  # what the ranks read: resolved, equal
    assert again.run.steps == 4 and again.policy.model == cfg.policy.model and again.run.run_dir == str(tmp_path)
    # one machine: torchrun with the rendezvous store on loopback (tests/e2e/test_run_processes.py
    # checks every listening socket of a live run)
    one = launched["nodes"].torchrun()
    assert one[1:3] == ["-m", "yatt_mm.loopback"] and one[one.index("--rdzv-backend") + 1] == "yatt-mm-loopback"
    assert one[one.index("--rdzv-endpoint") + 1] == "127.0.0.1:0" and "--standalone" not in one

    # one of several machines: torchrun's static rendezvous at node 0, a run dir every node sees
    nodes = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "29555"]
    assert launch.run_command("t", RLConfig, "m", lambda cfg: 1, argv[:-1] + nodes) == 2  # no explicit run dir
    assert launch.run_command("t", RLConfig, "m", lambda cfg: 1, argv + nodes) == 0
    assert launched["nodes"].torchrun()[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                                                "--master-addr", "10.0.0.7", "--master-port", "29555"]


def test_a_world_that_does_not_fit_the_tensor_parallel_size_is_refused(capsys):
    import yatt_mm.launch as launch

    argv = ["--config", "configs/tiny_demo.yaml", "--nproc", "3", "policy.trainer.tensor_parallel=2", *TINY]
    assert launch.run_command("t", RLConfig, "m", lambda cfg: 0, argv) == 2
    assert "multiple of policy.trainer.tensor_parallel x policy.trainer.pipeline_parallel = 2 x 1" in capsys.readouterr().err
