import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dataio.synth import colour_image, moving_ball_video
from models.tiny import is_built, make_tiny_model


def _tensors(path):
    return load_file(str(path / "model.safetensors"))


def test_build_is_deterministic_per_seed(tmp_path, tiny_policy):
    same, built = make_tiny_model(tmp_path / "same", kind="policy", seed=0)
    assert built
    ref, new = _tensors(tiny_policy), _tensors(same)
    assert ref.keys() == new.keys()
    assert all(torch.equal(ref[k], new[k]) for k in ref)
    assert (tiny_policy / "tokenizer.json").read_text() == (same / "tokenizer.json").read_text()

    other, _ = make_tiny_model(tmp_path / "other", kind="policy", seed=1)
    assert not torch.equal(_tensors(other)["lm_head.weight"], ref["lm_head.weight"])


def test_cached_build_is_reused_and_foreign_dirs_are_refused(tmp_path, tiny_policy):
    path, built = make_tiny_model(tiny_policy, kind="policy", seed=0)
    assert path == tiny_policy and not built
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(FileExistsError, match="does not hold a tiny policy model"):
        make_tiny_model(tmp_path / "junk", kind="policy", seed=0)
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        make_tiny_model(tmp_path / "k", kind="critic", seed=0)


def test_concurrent_first_builds_share_one_and_a_broken_cache_entry_is_rebuilt(tmp_path):
    """Ranks of a fresh machine build the same tiny model at once (a CI run lost the judge's
    weights that way): all get the same complete model, also when a rank other than 0 builds it
    (transformers' save_pretrained writes nothing on a rank > 0 of a process group: ranks 1 and 2
    go first here, rank 0 waits for them); an entry missing its weights is rebuilt."""
    import os
    import subprocess
    import sys

    ranks = """if True:
        import sys
        import torch.distributed as dist
        from models.tiny import is_built, tiny_model_dir
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=3)
        if dist.get_rank() == 0:
            dist.barrier()  # rank 0 comes last: ranks 1 and 2 build
        path = tiny_model_dir("judge")
        print(path, is_built(path, "judge", 0), flush=True)  # complete the moment it is returned?
        if dist.get_rank() > 0:
            dist.barrier()
        dist.destroy_process_group()
    """
    env = {**os.environ, "YATT_MM_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", ranks, str(tmp_path / "rendezvous"), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(3)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:  # none left building if one hangs
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(got) == 1, got  # one path, complete in every rank the moment it was returned
    path, complete = got.pop().rsplit(" ", 1)
    assert complete == "True"
    assert is_built(path, "judge", 0)
    os.unlink(os.path.join(path, "model.safetensors"))
    assert not is_built(path, "judge", 0)
    code = "from models.tiny import tiny_model_dir; print(tiny_model_dir('judge'))"
    rebuilt = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 0 and is_built(path, "judge", 0), rebuilt.stderr[-2000:]


def test_judge_kind_differs_from_policy(tmp_path):
    judge, _ = make_tiny_model(tmp_path / "judge", kind="judge", seed=0)
    cfg = json.loads((judge / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 3


def test_transformers_runs_image_and_video(tiny_policy):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_policy)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_policy).eval()
    rng = random.Random(0)
    img, vid = colour_image(rng), moving_ball_video(rng)
    for part, media in [("image", {"images": [img.image]}), ("video", {"videos": [vid.video]})]:
        messages = [{"role": "user", "content": [{"type": part}, {"type": "text", "text": "Hi"}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], return_tensors="pt", **media)
        pad_id = model.config.image_token_id if part == "image" else model.config.video_token_id
        n_pad = int((inputs["input_ids"] == pad_id).sum())
        assert n_pad > 1, f"the {part} was not expanded into its tokens"
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.shape[:2] == inputs["input_ids"].shape
        assert torch.isfinite(logits).all()
        assert logits.shape[-1] == len(processor.tokenizer)


def test_chat_template_marks_media_in_place(tiny_policy):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Q"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Q" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert np.all([tok.convert_tokens_to_ids(t) != tok.unk_token_id for t in ["<|image_pad|>", "<|video_pad|>"]])
