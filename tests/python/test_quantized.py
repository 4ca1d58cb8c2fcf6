"""A frozen quantised base for LoRA (`model.quantize`): the routed experts held in bitsandbytes'
NF4 / FP4 / int8 formats, checked against bitsandbytes itself (codes, scales and dequantised values
bit for bit), the dequantising grouped GEMM against the grouped GEMM on the dequantised weights, and
`automoe train` on a quantised base against the same run on a checkpoint of bitsandbytes'
dequantised weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_train import base_recipe, load_tensors, metrics, model_dir, run_train, tokenizer  # noqa: F401
from test_train_lora import EXPERTS

import automoe  # (registers torch.ops.automoe)

bnb_functional = pytest.importorskip("bitsandbytes.functional")

OPS = torch.ops.automoe


def bnb_quantize(w: torch.Tensor, quant_type: str, blocksize: int):
    """bitsandbytes' codes and scales for one weight [O, K], as Linear4bit / Linear8bitLt store them."""
    if quant_type == "int8":  # Linear8bitLt quantises the weight in float16
        codes, scb, _ = bnb_functional.int8_vectorwise_quant(w.to(torch.float16))
        return codes, scb
    codes, state = bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type)
    return codes, state.absmax


def bnb_dequantize(w: torch.Tensor, quant_type: str, blocksize: int = 64) -> torch.Tensor:
    """w [O, K] quantised and dequantised by bitsandbytes, in w's dtype."""
    if quant_type == "int8":
        codes, scb = bnb_quantize(w, "int8", 0)
        return bnb_functional.int8_vectorwise_dequant(codes, scb).to(w.dtype)
    codes, state = bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type)
    return bnb_functional.dequantize_4bit(codes, state)


# ---- the formats ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,blocksize", [((96, 128), 64), ((33, 17), 64), ((64, 256), 128),
                                             ((8, 64), 4096)],
                         ids=["blocks", "odd-partial-block", "block128", "one-partial-block"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4", "int8"])
def test_quantisation_is_bitsandbytes_bit_for_bit(quant_type, shape, blocksize, dtype):
    if quant_type == "int8" and blocksize != 64:
        pytest.skip("int8 has one scale per row")
    for seed in range(8):  # (bf16 values often fall exactly between two int8 codes)
        torch.manual_seed(seed)
        w = torch.randn(shape).to(dtype)
        w[0, :5] = 0  # exact zeros (FP4 has two zero codes)
        w[1] = 0      # an all-zero block / row
        codes, absmax = OPS.quantize(w, quant_type, blocksize)
        ref_codes, ref_absmax = bnb_quantize(w, quant_type, blocksize)
        assert torch.equal(codes.flatten(), ref_codes.flatten()), seed
        assert torch.equal(absmax.flatten(), ref_absmax.flatten()), seed
        ours = OPS.dequantize(codes, absmax, quant_type, blocksize, list(shape), dtype)
        assert torch.equal(ours, bnb_dequantize(w, quant_type, blocksize)), seed
        assert torch.equal(ours, OPS.dequantize_reference(codes, absmax, quant_type, blocksize, list(shape), dtype))


def test_bad_quantised_inputs_are_refused_by_name():
    w = torch.randn(2, 8, 64)
    w[1, 3, 7] = float("nan")
    with pytest.raises(automoe.AutoMoEError, match="expert 1 holds non-finite values"):
        OPS.quantize(w, "nf4", 64)
    with pytest.raises(automoe.AutoMoEError, match='unknown quantisation "nf3"'):
        OPS.quantize(w, "nf3", 64)
    codes, absmax = OPS.quantize(torch.randn(2, 8, 64), "nf4", 64)
    with pytest.raises(automoe.AutoMoEError, match="block size must be even"):
        OPS.dequantize(codes, absmax, "nf4", 0, [2, 8, 64], torch.float32)
    x = torch.randn(10, 64)
    with pytest.raises(automoe.AutoMoEError, match="offsets must be non-decreasing"):
        OPS.grouped_gemm_quantized(x, codes, absmax, "nf4", 64, [2, 8, 64], torch.tensor([0, 5, 2]))
    with pytest.raises(automoe.AutoMoEError, match="is past x's 10 rows"):
        OPS.grouped_gemm_quantized(x, codes, absmax, "nf4", 64, [2, 8, 64], torch.tensor([0, 5, 12]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_dequantising_grouped_gemm_equals_the_grouped_gemm_on_dequantised_weights(quant_type, dtype):
    """Forward and dX, with an expert without rows and rows past the last expert (zeros)."""
    torch.manual_seed(1)
    E, O, K = 5, 48, 64
    w = torch.randn(E, O, K)
    codes, absmax = OPS.quantize(w, quant_type, 64)
    dense = OPS.dequantize(codes, absmax, quant_type, 64, [E, O, K], dtype)
    offsets = torch.tensor([0, 3, 3, 10, 11, 20])
    x = torch.randn(22, K, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = OPS.grouped_gemm_quantized(x, codes, absmax, quant_type, 64, [E, O, K], offsets)
    y2 = OPS.grouped_gemm_reference(x2, dense, offsets)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    assert torch.equal(y[20:], torch.zeros_like(y[20:]))


# ---- training on a quantised base ---------------------------------------------------------------

def dequantised_checkpoint(model_dir: Path, out: Path, quant_type: str) -> Path:
    """model_dir with every routed expert's weights replaced by bitsandbytes' quantised-then-
    dequantised values (each expert's projection quantised as bitsandbytes quantises a linear
    layer), written by Transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.stack([bnb_dequantize(p[e], quant_type) for e in range(p.shape[0])]))
    model.save_pretrained(out)
    for f in Path(model_dir).iterdir():  # the tokenizer's files (chat template included)
        if not (out / f.name).exists() and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    return out


def qlora_recipe(model_dir, tmp, run, quantize=None, **model):
    section = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
               "target_parameters": EXPERTS}
    r = base_recipe(model_dir, tmp, run, peft=section, optimizer={"lr": 1e-2})
    if quantize:
        r["model"]["quantize"] = quantize
    r["model"].update(model)
    return r


@pytest.mark.parametrize("quant_type,backend", [("nf4", "grouped"), ("nf4", "eager"), ("fp4", "grouped"),
                                                ("int8", "grouped")])
def test_lora_on_a_quantised_base_equals_lora_on_bitsandbytes_dequantised_weights(
        model_dir, tmp_path, quant_type, backend):
    """The quantised run's experts are bitsandbytes' values: its losses, gradient norms and
    adapters are those of the same LoRA run on a float32 checkpoint of those values."""
    deq = dequantised_checkpoint(model_dir, tmp_path / "deq", quant_type)
    q = qlora_recipe(model_dir, tmp_path, "q", quant_type, backend={"experts": backend})
    ref = qlora_recipe(deq, tmp_path, "ref", backend={"experts": backend})
    run_train(q, tmp_path)
    run_train(ref, tmp_path)
    a, b = metrics(tmp_path / "q"), metrics(tmp_path / "ref")
    for step in b:
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-6), step
        assert a[step]["grad_norm"] == pytest.approx(b[step]["grad_norm"], rel=1e-5), step
    got = load_tensors(tmp_path / "q" / "export" / "adapter_model.safetensors")
    want = load_tensors(tmp_path / "ref" / "export" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_merged_export_of_a_quantised_base_is_its_dequantised_weights_plus_the_adapter(
        model_dir, tmp_path):
    """export_merged writes bitsandbytes' dequantised experts + ΔW, loadable by Transformers with
    the logits of the dequantised base with PEFT's adapter on it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    deq = dequantised_checkpoint(model_dir, tmp_path / "deq", "nf4")
    recipe = qlora_recipe(model_dir, tmp_path, "q", "nf4")
    recipe["peft"]["export_merged"] = True
    proc = run_train(recipe, tmp_path)
    assert "dequantised values plus the adapters' product" in proc.stderr + proc.stdout
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "q" / "export-merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "q" / "export")
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_lora_on_an_nf4_base_trains_and_holds_no_expert_weight(model_dir, tmp_path):
    recipe = qlora_recipe(model_dir, tmp_path, "run", "nf4", dtype="bfloat16", quantize_blocksize=128)
    recipe["train"]["max_steps"] = 8
    recipe["checkpoint"]["every"] = 4
    proc = run_train(recipe, tmp_path)
    saved = load_tensors(tmp_path / "run" / "step-4" / "model.safetensors")
    assert all(".lora_" in k for k in saved)
    recs = metrics(tmp_path / "run")
    assert recs[8]["loss"] < recs[1]["loss"]
    assert "nf4" in proc.stderr + proc.stdout


# ---- checkpoints bitsandbytes quantised ---------------------------------------------------------

QUANTISED_LINEARS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "q_proj.weight",
                     "k_proj.weight", "v_proj.weight", "o_proj.weight")


def bnb_checkpoint(model_dir: Path, out: Path, quant_type: str, double_quant: bool) -> tuple[Path, Path]:
    """model_dir (per-expert layout, as Transformers writes it) with every expert's and attention's
    linear weight stored as bitsandbytes serialises Linear4bit / Linear8bitLt (QuantState.as_dict,
    SCB + weight_format), config.json with BitsAndBytesConfig's quantization_config; and beside it
    the same checkpoint with those weights replaced by bitsandbytes' dequantised values."""
    from safetensors.torch import load_file, save_file
    from transformers import BitsAndBytesConfig

    src = load_file(str(model_dir / "model.safetensors"))
    assert any(".experts.0.gate_proj.weight" in k for k in src), "expected the per-expert layout"
    quant, deq = {}, {}
    for name, w in src.items():
        if not name.endswith(QUANTISED_LINEARS):
            quant[name] = deq[name] = w
            continue
        if quant_type == "int8":
            codes, scb = bnb_quantize(w, "int8", 0)
            quant[name] = codes
            quant[name[: -len("weight")] + "SCB"] = scb
            quant[name[: -len("weight")] + "weight_format"] = torch.tensor(0, dtype=torch.uint8)
            deq[name] = bnb_functional.int8_vectorwise_dequant(codes, scb).to(w.dtype)
            continue
        codes, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type=quant_type,
                                                    compress_statistics=double_quant)
        quant[name] = codes
        for k, v in state.as_dict(packed=True).items():
            quant[f"{name}.{k}"] = v
        deq[name] = bnb_functional.dequantize_4bit(codes, state)
    config = json.loads((model_dir / "config.json").read_text())
    qcfg = BitsAndBytesConfig(load_in_8bit=quant_type == "int8", load_in_4bit=quant_type != "int8",
                              bnb_4bit_quant_type=quant_type if quant_type != "int8" else "fp4",
                              bnb_4bit_use_double_quant=double_quant)
    dirs = []
    for sub, tensors, cfg in (("bnb", quant, {**config, "quantization_config": qcfg.to_dict()}),
                              ("bnb-dequantised", deq, config)):
        d = out / sub
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        for f in model_dir.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                shutil.copy(f, d / f.name)
        dirs.append(d)
    return dirs[0], dirs[1]


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("nf4", False), ("fp4", False),
                                                     ("int8", False)],
                         ids=["nf4-double-quant", "nf4", "fp4", "int8"])
def test_a_bitsandbytes_quantised_checkpoint_trains_lora_on_its_quantised_experts(
        model_dir, tmp_path, quant_type, double_quant):
    """The experts load as stored (each expert's gate and up joined, never dequantised), attention's
    quantised weights dequantised: the LoRA run equals the run on bitsandbytes' dequantised values."""
    bnb, deq = bnb_checkpoint(model_dir, tmp_path, quant_type, double_quant)
    proc = run_train(qlora_recipe(bnb, tmp_path, "q"), tmp_path)
    assert "dequantised 8 bitsandbytes-quantised" in proc.stderr, proc.stderr
    run_train(qlora_recipe(deq, tmp_path, "ref"), tmp_path)
    a, b = metrics(tmp_path / "q"), metrics(tmp_path / "ref")
    for step in b:
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-6), step
    got = load_tensors(tmp_path / "q" / "export" / "adapter_model.safetensors")
    want = load_tensors(tmp_path / "ref" / "export" / "adapter_model.safetensors")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    # The plan counts the experts as stored (codes + scales), not in the compute dtype.
    plan = automoe.plan(qlora_recipe(bnb, tmp_path, "plan"), memory=64, peak_tflops=1.0)
    items = {m["name"]: m["bytes"] for m in plan["plan"]["memory"]}
    experts = 2 * 4 * (2 * 16 * 32 + 32 * 16)  # layers x experts x (gate_up + down) elements
    assert items["quantised experts"] == pytest.approx(experts * (1.0 if quant_type == "int8" else 0.5 + 4 / 64))
    # Trained in full, the quantised experts are refused by name; so is requantising them.
    full = base_recipe(bnb, tmp_path, "full")
    proc = run_train(full, tmp_path, check=False)
    assert proc.returncode != 0 and "trains only under LoRA" in proc.stderr, proc.stderr
    other = "int8" if quant_type != "int8" else "nf4"
    proc = run_train(qlora_recipe(bnb, tmp_path, "re", other), tmp_path, check=False)
    assert proc.returncode != 0 and f"model.quantize asks for {other}" in proc.stderr, proc.stderr


def test_a_checkpoint_transformers_quantised_with_bitsandbytes_loads_and_trains(model_dir, tmp_path):
    """Transformers + bitsandbytes quantise the linear layers (attention here; Transformers leaves the
    fused experts as they are) and save them double-quantised: AutoMoE loads that checkpoint and
    trains LoRA as on Transformers' own dequantize() of it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=qcfg)
    model.save_pretrained(tmp_path / "bnb")
    model.dequantize(dtype=torch.float32)  # (its default reads config.dtype, a string, and fails)
    model.save_pretrained(tmp_path / "deq")
    for d in ("bnb", "deq"):
        for f in model_dir.iterdir():
            if not (tmp_path / d / f.name).exists() and "safetensors" not in f.name:
                shutil.copy(f, tmp_path / d / f.name)
    assert "quantization_config" in json.loads((tmp_path / "bnb" / "config.json").read_text())
    proc = run_train(qlora_recipe(tmp_path / "bnb", tmp_path, "q"), tmp_path)
    assert "bitsandbytes-quantised (nf4)" in proc.stderr, proc.stderr
    run_train(qlora_recipe(tmp_path / "deq", tmp_path, "ref"), tmp_path)
    a, b = metrics(tmp_path / "q"), metrics(tmp_path / "ref")
    for step in b:
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-6), step


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_the_drop_in_gives_transformers_and_bitsandbytes_logits_on_their_quantised_checkpoint(
        model_dir, tmp_path, quant):
    """A checkpoint Transformers + bitsandbytes wrote (quantised attention, dense experts): the drop-in
    loads it dequantised, with the logits Transformers + bitsandbytes compute on it — within what
    bitsandbytes' own CPU matmul differs from the same weights dequantised, measured here."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qcfg = (BitsAndBytesConfig(load_in_8bit=True) if quant == "int8" else
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32))
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                         quantization_config=qcfg).save_pretrained(tmp_path / "bnb")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bnb", dtype=torch.float32).train()
    ours = automoe.AutoModelForCausalLM.from_pretrained(tmp_path / "bnb", dtype=torch.float32)
    assert getattr(ours.config, "quantization_config", None) is None  # loaded dequantised
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(input_ids=ids).logits
        hf.dequantize(dtype=torch.float32)
        plain = hf(input_ids=ids).logits  # the same weights, dequantised, through torch's matmul
    own = (want - plain).abs().max().item()  # bitsandbytes' CPU path against its own weights
    print(f"{quant}: ours vs bnb {(got - want).abs().max().item():.2e}, bnb vs dequantised {own:.2e}")
    assert (got - want).abs().max().item() <= max(2 * own, 1e-5), own


def test_export_merge_onto_a_bitsandbytes_checkpoint_merges_into_its_dequantised_experts(model_dir, tmp_path):
    """`automoe export --merge --base <bnb checkpoint>`: the experts stored quantised merge as
    bitsandbytes' values + ΔW — the logits of PEFT's adapter on the dequantised checkpoint."""
    import subprocess

    from conftest import AUTOMOE_BIN
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    bnb, deq = bnb_checkpoint(model_dir, tmp_path, "nf4", True)
    recipe = qlora_recipe(bnb, tmp_path, "q")
    recipe["train"]["max_steps"] = 2
    run_train(recipe, tmp_path)
    proc = subprocess.run([str(AUTOMOE_BIN), "export", str(tmp_path / "q" / "export"), str(tmp_path / "out"),
                           "--merge", "--base", str(bnb)], capture_output=True, text=True)
    assert proc.returncode == 0 and "dequantised values plus the adapters' product" in proc.stderr, proc.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32),
                                    tmp_path / "q" / "export")
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_a_tiled_int8_weight_of_old_bitsandbytes_is_refused_by_name(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bnb, _ = bnb_checkpoint(model_dir, tmp_path, "int8", False)
    tensors = load_file(str(bnb / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight_format"
    tensors[name] = torch.tensor(2, dtype=torch.uint8)  # col_turing
    save_file(tensors, str(bnb / "model.safetensors"), metadata={"format": "pt"})
    proc = run_train(qlora_recipe(bnb, tmp_path, "q"), tmp_path, check=False)
    assert proc.returncode != 0 and f"{name}: 2, expected 0 (row-major" in proc.stderr, proc.stderr


def test_the_drop_in_refuses_experts_stored_quantised_by_name(model_dir, tmp_path):
    bnb, _ = bnb_checkpoint(model_dir, tmp_path, "nf4", False)
    with pytest.raises(automoe.AutoMoEError, match="the drop-in holds dense weights"):
        automoe.AutoModelForCausalLM.from_pretrained(bnb)


def test_convert_writes_a_bitsandbytes_checkpoint_dequantised(model_dir, tmp_path):
    """`automoe convert` of a quantised checkpoint: bitsandbytes' values, no quantization_config,
    loadable by Transformers alone."""
    from conftest import AUTOMOE_BIN
    import subprocess

    bnb, deq = bnb_checkpoint(model_dir, tmp_path, "nf4", True)
    out = tmp_path / "converted"
    subprocess.run([str(AUTOMOE_BIN), "convert", str(bnb), str(out), "--layout", "per-expert"], check=True,
                   capture_output=True)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("model,message", [
    ({"quantize": "nf4"}, "trains only with a peft: section"),
    ({"quantize": "nf3"}, "model.quantize"),
    ({"quantize": "int8", "quantize_blocksize": 128}, "is for 4-bit quantisation"),
    ({"quantize": "nf4", "quantize_blocksize": 100}, "power of two"),
])
def test_quantise_recipe_errors_name_the_key(model_dir, tmp_path, model, message):
    recipe = qlora_recipe(model_dir, tmp_path, "run")
    if message == "trains only with a peft: section":
        del recipe["peft"]
    recipe["model"].update(model)
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
