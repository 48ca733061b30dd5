"""Inputs a run cannot use are refused before any rank starts: `yatt-mm rl` (or `sft`) exits 2
with one line on stderr naming the setting and the fix, and nothing else happens (no run
directory, nothing on stdout). Each case runs the command in this process, without --nproc: a
check that let its case through would go on to load models and run in-process, and the test
would fail on the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataio.synth import write_shards
from yatt_mm.cli import main
from yatt_mm.config import load
from yatt_mm.rl.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "tiny_demo.yaml"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prelaunch") / "train"
    write_shards(str(root), images=4, videos=0, samples_per_shard=4, seed=1, tasks=["colour"])
    return root


def _refused(capsys, tmp_path, argv: list[str], command: str = "rl") -> str:
    """The one stderr line of `yatt-mm COMMAND ARGV`, which must exit 2 having started nothing."""
    run_dir = tmp_path / "run"
    code = main([command, *argv, f"{'run.' if command == 'rl' else ''}run_dir={run_dir}"])
    out = capsys.readouterr()
    assert code == 2, (out.out[-2000:], out.err[-2000:])
    assert out.out == "" and not run_dir.exists()
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


def _rl(shards: Path, *settings: str) -> list[str]:
    """The demo config on the tiny policy (no warm start, no judge), reading `shards`."""
    return ["--config", str(DEMO), "policy.model=tiny:policy", "reward.judges=[]", f"data.shards=[{shards}]",
            f"eval.shards=[{shards}]", *settings]


# ---------------------------------------------------------------- the config file itself


def test_a_yaml_syntax_error_names_its_line_and_column(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("run:\n  steps: 3\n  name: [a, b\nrollout:\n  prompts_per_step: 2\n")
    assert _refused(capsys, tmp_path, ["--config", str(config)]) == (
        f"yatt-mm rl: config error: config file {config}: YAML syntax error at line 4, column 8: expected ',' or "
        "']', but got ':' (while parsing a flow sequence, which starts at line 3, column 9)")


def test_a_config_file_that_is_not_utf8_names_the_byte_and_where(capsys, tmp_path):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("run:\n  name: café\n".encode("latin-1"))
    assert _refused(capsys, tmp_path, ["--config", str(config)]) == (
        f"yatt-mm rl: config error: config file {config} is not UTF-8 text: byte 0xe9 at line 2, column 12; save it "
        "as UTF-8")


def test_an_override_whose_value_is_not_yaml_names_the_override(capsys, tmp_path, shards):
    assert _refused(capsys, tmp_path, _rl(shards, "data.shards=[a, b")) == (
        "yatt-mm rl: config error: override 'data.shards=[a, b': the value is not valid: YAML syntax error at column "
        "6: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence, which starts at column 1) "
        "(quote a value meant as text)")


# ---------------------------------------------------------------- the data the run reads


@pytest.mark.parametrize("setting, line", [
    ("data.shards=[{missing}]",
     "data.shards: {missing} does not exist (give tar files, a directory of them or a glob)"),
    ("data.shards=[{empty}]", "data.shards: the directory {empty} holds no shards (.tar, or .tar.gz, .tgz, .tar.bz2, "
                              ".tar.xz files); make them with yatt-mm prep or yatt-mm data synth"),
    ("data.shards=[{shards}, '{empty}/*.tar']", "data.shards[1]: {empty}/*.tar matches no file"),
    ("data.index={missing}", "data.index: {missing} does not exist; build it with `yatt-mm data index SHARDS... "
                             "--out INDEX` or leave it unset (the index is then built from the shards)"),
    ("data.blend=[{{name: a, shards: [{shards}]}}, {{name: b, shards: [{missing}]}}]",
     "data.blend[1].shards: {missing} does not exist (give tar files, a directory of them or a glob)"),
    ("eval.shards=[{empty}]", "eval.shards: the directory {empty} holds no shards (.tar, or .tar.gz, .tgz, "
                              ".tar.bz2, .tar.xz files); make them with yatt-mm prep or yatt-mm data synth"),
    ("eval.sets=[{{name: a, shards: [{shards}]}}, {{name: b, shards: [{missing}]}}]",
     "eval.sets[1].shards: {missing} does not exist (give tar files, a directory of them or a glob)"),
])
def test_shards_that_are_not_there_are_refused_naming_the_setting(capsys, tmp_path, shards, setting, line):
    places = {"missing": tmp_path / "nowhere", "empty": tmp_path / "empty", "shards": shards}
    places["empty"].mkdir()
    # a blend or eval sets replace the single dataset the helper sets
    extra = ["data.shards=[]"] if setting.startswith("data.blend") else []
    extra += ["eval.shards=[]"] if setting.startswith("eval.sets") else []
    got = _refused(capsys, tmp_path, _rl(shards, *extra, setting.format(**places)))
    assert got == "yatt-mm rl: " + line.format(**places)


def test_shards_in_a_bucket_that_is_not_there_or_not_allowed_are_refused_naming_the_url(capsys, tmp_path, shards,
                                                                                         s3_store, monkeypatch):
    """The same check for URLs, against a real S3 server (moto, tests/s3_store.py): a missing
    object, a missing bucket, a key without the right (a real 403) and credentials in the URL are
    refused in the same way, and the secret key is nowhere in what the command prints."""
    url = s3_store.upload_dir(shards, "prelaunch", "train", "*.tar")
    for k, v in s3_store.admin.env(s3_store.endpoint).items():
        monkeypatch.setenv(k, v)
    lines = [_refused(capsys, tmp_path, _rl(shards, f"data.shards=[{url}/shard-000009.tar]")),
             _refused(capsys, tmp_path, _rl(shards, f"eval.shards=[s3://no-such-bucket/{shards.name}]"))]
    assert lines == [f"yatt-mm rl: data.shards: {url}/shard-000009.tar does not exist",
                     f"yatt-mm rl: eval.shards: s3://no-such-bucket/{shards.name}: the bucket does not exist (or is "
                     f"not at this endpoint: AWS_ENDPOINT_URL={s3_store.endpoint})"]
    for k, v in s3_store.nobody.env(s3_store.endpoint).items():
        monkeypatch.setenv(k, v)
    denied = _refused(capsys, tmp_path, _rl(shards, f"data.shards=[{url}]"))
    assert denied.startswith(f"yatt-mm rl: data.shards: {url}: access denied (403) when listing it"), denied
    signed_url = f"{url}?X-Amz-Signature={s3_store.nobody.secret_key}"
    signed = _refused(capsys, tmp_path, _rl(shards, f"data.shards=['{signed_url}']"))
    assert signed.startswith(f"yatt-mm rl: config error: data: data.shards[0]: {url} is given with credentials in "
                             "the URL"), signed
    assert not [line for line in [*lines, denied, signed] if s3_store.nobody.secret_key in line
                or s3_store.admin.secret_key in line]


def test_sft_checks_its_shards_too(capsys, tmp_path):
    assert _refused(capsys, tmp_path, ["--config", str(ROOT / "configs" / "tiny_sft.yaml"),
                                       f"data.shards=[{tmp_path / 'nowhere'}]"], command="sft") == (
        f"yatt-mm sft: data.shards: {tmp_path / 'nowhere'} does not exist (give tar files, a directory of them or a "
        "glob)")


# ---------------------------------------------------------------- settings a run cannot meet


@pytest.mark.parametrize("settings, line", [
    (["rollout.sampling.max_tokens=100000"],
     "rollout.sampling.max_tokens=100000 leaves a prompt no room in rollout.engine.max_model_len=2048 (prompt and "
     "response share it, and a prompt with its media takes at least 4 tokens): set rollout.sampling.max_tokens <= "
     "2044, or raise rollout.engine.max_model_len"),
    (["eval.max_tokens=2045"],
     "eval.max_tokens=2045 leaves a prompt no room in rollout.engine.max_model_len=2048 (prompt and response share "
     "it, and a prompt with its media takes at least 4 tokens): set eval.max_tokens <= 2044, or raise "
     "rollout.engine.max_model_len"),
    (["data.max_sample_tokens=4096"],
     "data.max_sample_tokens=4096 admits samples (prompt, media and the response limit) that "
     "rollout.engine.max_model_len=2048 cannot hold: set data.max_sample_tokens <= 2048, or raise max_model_len"),
    (["data.max_sample_tokens=1000", "rollout.sampling.max_tokens=990"],
     "rollout.sampling.max_tokens=990 leaves no prompt budget in data.max_sample_tokens=1000 (the budget counts the "
     "response limit, a 32-token chat template and the prompt with its media): every sample would be skipped as "
     "over_token_budget; set max_tokens <= 964, or raise data.max_sample_tokens"),
    (["algorithm.mini_batches=9"],
     "algorithm.mini_batches=9 splits each DP group's step into mini-batches of whole groups, but a step has "
     "rollout.prompts_per_step=8 groups: the extra optimizer steps would have nothing to train on; set mini_batches "
     "<= 8, or raise prompts_per_step"),
    (["rollout.sampling.n=1"],
     "rollout.sampling.n=1: algorithm.advantage=grpo measures a response against the other responses to its "
     "prompt, and a group of one has none (its advantage is always 0): set n >= 2, or "
     "algorithm.advantage=reinforce_pp"),
    (["rollout.sampling.n=1", "algorithm.advantage=reinforce_pp"],
     "rollout.sampling.n=1: dynamic sampling keeps groups whose rewards differ, which a group of one response never "
     "does (every step would be padded with masked groups): set n >= 2, or dynamic_sampling.enabled=false"),
    (["dynamic_sampling.max_wave_groups=2"],
     "dynamic_sampling: max_waves=3 waves of at most max_wave_groups=2 groups cannot fill a step of "
     "rollout.prompts_per_step=8 groups: raise max_wave_groups to >= 3 or max_waves"),
    (["rollout.engine.media_tokens_in_responses=true"],
     "rollout.engine.media_tokens_in_responses=true lets responses hold media placeholder tokens, which the trainer "
     "cannot train on (its positions and vision features would look for a medium behind each): set it to false"),
    (["rollout.sampling.temperature=3"], "rollout.sampling.temperature must be in [0, 2], got 3.0"),  # vLLM's range
    (["reward.functions[0].weight=-1"], "reward.functions[0].weight must be >= 0, got -1.0"),
    (["reward.judges=[{judge: {name: g, model: 'tiny:judge'}, weight: -0.5}]"],
     "reward.judges[0].weight must be >= 0, got -0.5"),
    (["reward.functions[0].weight=0"],
     "reward: every reward weight is 0, so every response's reward is 0 and no group ever trains: give a function "
     "or a judge a weight > 0"),
])
def test_settings_a_run_cannot_meet_are_refused_naming_them(capsys, tmp_path, shards, settings, line):
    assert _refused(capsys, tmp_path, _rl(shards, *settings)) == "yatt-mm rl: config error: " + line


def test_the_limits_themselves_are_accepted():
    """The checks refuse only what cannot run: each setting at its limit loads."""
    cfg = load(RLConfig, DEMO, ["rollout.sampling.max_tokens=2044", "eval.max_tokens=2044", "algorithm.mini_batches=8",
                                "reward.functions[0].weight=0", "rollout.sampling.n=1",
                                "algorithm.advantage=reinforce_pp", "dynamic_sampling.enabled=false"])
    assert cfg.rollout.sampling.max_tokens == 2044 and cfg.algorithm.mini_batches == 8
    load(RLConfig, DEMO, ["data.max_sample_tokens=2048", "rollout.sampling.max_tokens=2012",
                          "dynamic_sampling.max_wave_groups=3"])


def test_lora_on_a_mixture_of_experts_reaches_attention_and_experts_and_its_adapter_needs_a_gpu_engine(
        capsys, tmp_path, shards):
    """Qwen3-VL-MoE's adapters reach the attention's projections and the experts (it has no dense
    MLP); on a CPU-only machine vLLM cannot serve an adapter on an MoE model, so its LoRA runs
    sync the merged weights. Each refusal names the setting that fixes it."""
    from models.tiny import tiny_model_dir

    tiny_model_dir("qwen3vlmoe")
    capsys.readouterr()  # the build's progress is not the refusal's stderr
    moe = ["policy.model=tiny:qwen3vlmoe", "policy.lora.rank=8"]
    assert _refused(capsys, tmp_path, _rl(shards, *moe)) == (
        "yatt-mm rl: policy.lora.target_modules: Qwen3-VL-MoE's adapters reach q_proj, k_proj, v_proj, o_proj, "
        "experts only (not gate_proj, up_proj, down_proj: its MLPs are the experts: name them experts): set "
        "policy.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, experts]")
    assert _refused(capsys, tmp_path, _rl(shards, *moe, "policy.lora.dropout=0.1",
                                          "policy.lora.target_modules=[experts]")).startswith(
        "yatt-mm rl: config error: policy.lora: dropout=0.1 with target_modules naming experts")
    attention = [*moe, "policy.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, experts]"]
    assert _refused(capsys, tmp_path, _rl(shards, *attention, "sync.lora=adapter")) == (
        "yatt-mm rl: sync.lora=adapter: vLLM's CPU build cannot serve a LoRA adapter on a mixture-of-experts model "
        "(its experts' LoRA path needs Triton's GPU kernels): set sync.lora=merged (the adapter merged into its "
        "weights, synced as full weights are)")
    cfg = load(RLConfig, DEMO, ["policy.model=" + str(tiny_model_dir("qwen3vlmoe")), *attention[1:]])
    cfg.check_model()  # the merged sync (the default) is accepted
    # yatt-mm eval of such a run's final adapter, likewise, before any engine starts
    from models.lora import ADAPTER_CONFIG, LoRAConfig, peft_config

    final = tmp_path / "final"
    final.mkdir()
    (final / ADAPTER_CONFIG).write_text(json.dumps(peft_config(LoRAConfig(rank=8), str(tiny_model_dir("qwen3vlmoe")))))
    assert main(["eval", "--config", str(DEMO), "--model", str(final), f"eval.shards=[{shards}]"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"yatt-mm eval: --model {final} (a LoRA adapter): vLLM's CPU build cannot serve a LoRA adapter on a "
        "mixture-of-experts model (its experts' LoRA path needs Triton's GPU kernels): merge it into its base first "
        "(yatt-mm export ADAPTER_DIR --merge --out DIR) and evaluate DIR")


# ---------------------------------------------------------------- the pipeline-stage hint


def test_more_pipeline_stages_than_layers_is_refused_with_a_stage_count_that_fits(capsys, tmp_path, shards,
                                                                                   tiny_policy):
    """The tiny policy (built by the fixture, so its build's progress is not on this stderr) has
    2 language layers."""
    assert _refused(capsys, tmp_path, _rl(shards, "--nproc", "3", "policy.trainer.pipeline_parallel=3")) == (
        "yatt-mm rl: policy.trainer.pipeline_parallel=3: the model has 2 language layers and every pipeline stage "
        "needs at least 1: set policy.trainer.pipeline_parallel to at most 2 (2: one layer a stage)")
