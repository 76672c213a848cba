"""The KV spec the compiler derives from a .kvm (compiler/kv_spec.py): the manifest's `kv_spec` of
every shipped method, the generated `kv_spec(...)` of hooks.py, and what `DecodeHooks.kv_spec`
serves from it. The served methods' specs must equal what the engine built by hand before the
compiler derived them: dense K/V plus one float32 plane per paged decode state."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from kvc.compiler import codegen, kv_spec
from kvc.compiler.cache import CACHE_ENV
from kvc.compiler.cli import OUTPUT_DIR
from kvc.dsl import METHODS_DIR, check_file
from kvc.dsl.errors import KvmError
from kvc.runtime.kv import spec as runtime_spec
from kvc.runtime.kv.spec import Dense, Extent, Quantized, Summary, TensorSpec, dense_spec, state_plane
from kvc.runtime.methods import resolve_method
from kvc.runtime.compiled.method import CompiledMethod

SHIPPED = sorted(p.stem for p in METHODS_DIR.glob("*.kvm"))
# the served methods and the state planes the engine kept for them before the compiler derived the spec
SERVED_PLANES = {"full": (), "streamingllm": (), "snapkv": (), "pyramidkv": (), "adakv": (),
                 "tova": ("decode_after_attention.scores",), "h2o": ("seen", "decode_after_attention.scores")}
SHAPES = [(2, 16, torch.float32, 4), (8, 128, torch.bfloat16, 16)]  # num_kv_heads, head_dim, dtype, page_size


def manifest(name: str) -> dict:
    return json.loads((OUTPUT_DIR / name / "manifest.json").read_text())


def generated_kv_spec(method: str, params: dict | None = None):
    """The generated `kv_spec` source of a (possibly not lowered) shipped method, run with the runtime's names."""
    checked = check_file(METHODS_DIR / f"{method}.kvm")
    namespace = {"math": math, "torch": torch, **{n: getattr(runtime_spec, n) for n in (
        "Dense", "Extent", "KVSpec", "Quantized", "Summary", "TensorSpec", "state_plane")}}
    exec(kv_spec.emit_python(kv_spec.derive(checked, None), method, f"methods/{method}.kvm"), namespace)
    return lambda *shape: namespace["kv_spec"](*shape, {**checked.values, **(params or {})})


@pytest.mark.parametrize("planes", [True, False])
@pytest.mark.parametrize("name", sorted(SERVED_PLANES))
def test_served_specs_equal_the_hand_built_ones(name, planes, monkeypatch):
    monkeypatch.setattr(CompiledMethod, "use_state_planes", planes)
    method = resolve_method(name, None)
    assert method.state_planes == (SERVED_PLANES[name] if planes else ())
    for shape in SHAPES:
        heads, head_dim, dtype, page_size = shape
        spec = method.kv_spec(*shape)
        # a decode-time keep evicts in place and stores each slot's position, unless per-row dicts hold
        # the decode state (they follow slot order)
        in_place = name == "streamingllm" or (planes and name in ("h2o", "tova"))
        positions = (TensorSpec("slot.position", Extent.TOKEN, torch.int32),) if in_place else ()
        before = dense_spec(head_dim, dtype, extra=tuple(state_plane(n) for n in method.state_planes) + positions)
        assert spec.tensors == before.tensors  # same tensors, same order
        assert (spec.keys, spec.values, spec.summaries) == (Dense("k"), Dense("v"), ())
        assert spec.bytes_per_token(heads) == before.bytes_per_token(heads)
        assert spec.bytes_per_token(heads) == heads * (2 * head_dim * dtype.itemsize + 4 * len(method.state_planes)
                                                       + 4 * in_place)
        assert spec.bytes_per_page(heads, page_size) == before.bytes_per_page(heads, page_size)
        assert spec.head_starts is (name == "adakv")  # Ada-KV's per-head counts, stored right-aligned
        assert spec.positions == ("slot.position" if in_place else None)
        assert spec.in_place is in_place
        assert spec == dataclasses.replace(before, head_starts=spec.head_starts, positions=spec.positions,
                                           in_place=spec.in_place)


def test_every_shipped_method_has_a_kv_spec():
    for name in SHIPPED:
        spec = manifest(name)["kv_spec"]
        assert set(spec) == {"tensors", "keys", "values", "summaries", "head_starts", "positions", "in_place",
                             "page_tokens", "layers", "reason"}, name
        if spec["positions"] is not None:  # a keep in place: each slot's position, one int32
            assert {"name": spec["positions"], "extent": "token", "dtype": "int32", "shape": [],
                    "packing": ""} in spec["tensors"], name
        kinds = {spec["keys"]["kind"], spec["values"]["kind"]}
        assert kinds <= {"dense", "quantized", "low_rank", "delta", "unmapped"}, name
        if "unmapped" in kinds:  # what the spec cannot hold is said, with the .kvm position
            assert spec["reason"] and f"{name}.kvm:" in spec["reason"], name
        listed = {t["name"] for t in spec["tensors"]}
        for enc in (spec["keys"], spec["values"]):
            parts = ("tensor", "codes", "scale", "zero", "residual", "latent", "down", "up", "bias")
            names = [enc.get(k) for k in parts]
            assert {n for n in names if n} <= listed, name
        if manifest(name)["lowered"]:
            assert "unmapped" not in kinds and spec["reason"] is None, name


def test_quest_summaries():
    spec = manifest("quest")["kv_spec"]
    assert spec["summaries"] == [{"tensor": "kmax", "source": "k", "fn": "max"},
                                 {"tensor": "kmin", "source": "k", "fn": "min"}]
    pages = [t for t in spec["tensors"] if t["extent"] == "page"]
    # a max or min of stored keys is one of them: the model dtype holds it exactly
    assert pages == [{"name": n, "extent": "page", "dtype": "model", "shape": ["head_dim"], "packing": ""}
                     for n in ("kmax", "kmin")]
    assert spec["page_tokens"] == "page_size" and spec["keys"] == {"kind": "dense", "tensor": "k"}
    built = generated_kv_spec("quest")(2, 16, torch.bfloat16, 16)
    assert built.summaries == (Summary("kmax", "k", "max"), Summary("kmin", "k", "min"))
    assert built.tensor("kmax") == TensorSpec("kmax", Extent.PAGE, torch.bfloat16, (16,))
    assert built.bytes_per_page(2, 16) == 2 * 16 * (2 * 16 * 2) + 2 * 2 * 16 * 2
    with pytest.raises(ValueError, match="pages of 16 tokens"):
        generated_kv_spec("quest")(2, 16, torch.bfloat16, 32)


def test_kivi_quantized_encodings():
    spec = manifest("kivi")["kv_spec"]
    assert spec["keys"] == {"kind": "quantized", "codes": "k_codes", "scale": "k_scale", "zero": "k_zero",
                            "bits": "bits", "group": "group_size", "axis": "token", "residual": "k_resid",
                            "flush_block": "residual_length", "prefill_exact": True}
    assert spec["values"] == {"kind": "quantized", "codes": "v_codes", "scale": "v_scale", "zero": "v_zero",
                              "bits": "bits", "group": "group_size", "axis": "channel", "residual": "v_resid",
                              "prefill_exact": True}
    tensors = {t["name"]: t for t in spec["tensors"]}
    assert tensors["k_codes"] == {"name": "k_codes", "extent": "token", "dtype": "uint8", "shape": ["bits*head_dim/8"],
                                  "packing": "from bits"}
    assert tensors["k_scale"]["extent"] == "page" and tensors["k_zero"]["extent"] == "page"
    assert tensors["k_scale"]["shape"] == [1, "head_dim"] and spec["page_tokens"] == "group_size"
    assert tensors["v_scale"] == {"name": "v_scale", "extent": "token", "dtype": "model",
                                  "shape": ["head_dim/group_size"], "packing": ""}
    assert tensors["k_resid"] == {"name": "k_resid", "extent": "seq", "dtype": "model",  # the newest R and the step's
                                  "shape": ["residual_length + 1", "head_dim"], "packing": ""}
    assert spec["reason"] is None
    for bits, packing in ((2, "int2x4"), (4, "int4x2")):
        built = generated_kv_spec("kivi", {"bits": bits, "group_size": 32, "residual_length": 128})(
            8, 128, torch.bfloat16, 32)
        assert built.keys == Quantized("k_codes", "k_scale", bits, 32, zero="k_zero", residual="k_resid", axis="token",
                                       flush_block=128, prefill_exact=True)
        assert built.values == Quantized("v_codes", "v_scale", bits, 32, zero="v_zero", residual="v_resid",
                                         axis="channel", prefill_exact=True)
        assert built.tensor("v_codes") == TensorSpec("v_codes", Extent.TOKEN, torch.uint8, (128 * bits // 8,), packing)
        assert built.tensor("k_scale") == TensorSpec("k_scale", Extent.PAGE, torch.bfloat16, (1, 128))
        assert built.tensor("v_zero") == TensorSpec("v_zero", Extent.TOKEN, torch.bfloat16, (4,))
        assert built.tensor("v_resid") == TensorSpec("v_resid", Extent.SEQ, torch.bfloat16, (129, 128))
        # per token: K and V codes, V's scale and zero (4 groups of 32 channels, bf16); K's scales are per page
        assert built.bytes_per_token(1) == 2 * 128 * bits // 8 + 2 * 4 * 2
        assert built.bytes_per_page(1, 32) == 32 * built.bytes_per_token(1) + 2 * 128 * 2
    with pytest.raises(ValueError, match="pages of 32 tokens"):
        generated_kv_spec("kivi", {"group_size": 32})(8, 128, torch.bfloat16, 16)
    # keys grouped over tokens are quantized a block at a time from the window: a window of 0 cannot be
    for residual in (0, 48):  # nor a block that is not whole groups
        with pytest.raises(ValueError, match="residual window|multiple of the group"):
            generated_kv_spec("kivi", {"residual_length": residual})(8, 128, torch.bfloat16, 32)


@pytest.mark.parametrize("name, params", [("kivi", {"bits": 2}), ("kivi", {"bits": 4, "group_size": 64}),
                                          ("kivi", {"bits": 2, "dense_layers": [0, 2]}),
                                          ("fp8", {}), ("full", {}), ("quest", {}), ("turboquant", {}),
                                          ("turboquant", {"key_bits": 4, "value_bits": 2})])
def test_the_budget_formulas_count_the_spec_bytes(name, params):
    """The manifest's `kv_bytes` (generated `slot_bytes`) is what the runtime spec stores a slot in each
    layer: codes, per-token scales and per-page scales spread over the page (KIVI-2: 96 bytes a KV head
    at head_dim 128 in bf16, against full's 512), and K and V in bf16 in the layers a `where` leaves
    dense (the layer's storage class)."""
    import importlib

    hooks = importlib.import_module(f"kvc.kernels_generated.{name}.hooks")
    checked = check_file(METHODS_DIR / f"{name}.kvm")
    values = {**checked.values, **params}
    page = hooks.page_tokens(values) or 16
    spec = generated_kv_spec(name, params)(4, 128, torch.bfloat16, page)
    slots = [hooks.slot_bytes(layer, kv_heads=4, head_dim=128, dtype_bytes=2, params=values) for layer in range(3)]
    for layer, slot in enumerate(slots):
        dense = hooks.dense_operands(values, layer) if hasattr(hooks, "dense_operands") else []
        assert slot * 4 == spec.with_dense(tuple(dense), 128, torch.bfloat16).bytes_per_page(4, page) / page
    shape = dict(layers=3, kv_heads=4, head_dim=128, dtype_bytes=2, params=values)
    assert hooks.kv_bytes(1000, **shape) == 4 * sum(slots) * 1000
    assert hooks.peak_prefill_bytes(700, **shape) == 4 * sum(slots) * 700
    if name == "kivi" and params["bits"] == 2:
        assert slots == ([512, 96, 512] if params.get("dense_layers") else [96] * 3)
    if name == "turboquant" and not params:  # 3-bit codes of K and V (48 bytes each) and a bf16 RMS each
        assert slots == [100] * 3


def test_turboquant_rotates_then_indexes_levels():
    """`rotate(random) then lloyd_max(bits)` lowers: codebook codes (3 bits: 8 to 3 bytes), one scale
    a token, the rotation named on each operand; a QJL stage after it does not lower (one quantizer
    an operand) and says so."""
    data = manifest("turboquant")
    assert data["lowered"] and data["attention"]["variant"] == "spec" and data["kv_spec"]["reason"] is None
    built = generated_kv_spec("turboquant", {"key_bits": 3, "value_bits": 4})(8, 128, torch.bfloat16, 16)
    assert built.keys == Quantized("k_codes", "k_scale", 3, 128, codebook="sphere", rotation="random",
                                   prefill_exact=True)
    assert built.tensor("k_codes") == TensorSpec("k_codes", Extent.TOKEN, torch.uint8, (48,), "int3x8")
    assert built.tensor("v_codes") == TensorSpec("v_codes", Extent.TOKEN, torch.uint8, (64,), "int4x2")
    assert built.tensor("v_scale") == TensorSpec("v_scale", Extent.TOKEN, torch.bfloat16, (1,))
    variant = METHODS_DIR.parent / "bench" / "variants" / "turboquant_prod.kvm"
    spec = kv_spec.derive(check_file(variant), None)
    assert "qjl" in "; ".join(spec.reasons)


def test_an_offset_is_for_keys_before_one_quantizer(tmp_path):
    """`residual(x[layer])` first, x an input [layer, kv_head, channel], is a key offset (a LAYER tensor
    of the input's name); on values, before FP8 codes or with a residual window it does not lower and
    says why at the store's line; a reference of another shape or an input fallback other than zeros
    is a check error."""
    head = ("method m : quantization\n\ninput k_mean: [layer, kv_head, channel] from \"m.safetensors\" or zeros\n"
            "input other: [layer, kv_head] from \"m.safetensors\"\n\n")
    cases = {
        "store k as residual(k_mean[layer]) then quant(4, group = 32, along channel)\n": None,
        "store v as residual(k_mean[layer]) then quant(4, group = 32, along channel)\n": "an offset is for keys",
        "store k as residual(k_mean[layer]) then fp8(e4m3, along kv_head, key, channel)\n": "leads one integer",
        "store k as residual(k_mean[layer]) then quant(2, group = 32, along key) except last 64\n": "no residual",
    }
    for store, reason in cases.items():
        path = tmp_path / "m.kvm"
        path.write_text(head + store)
        spec = kv_spec.derive(check_file(path), None).to_json()
        which = "keys" if store.startswith("store k") else "values"
        if reason is None:
            assert spec["keys"]["offset"] == "k_mean" and spec["reason"] is None
            assert {"name": "k_mean", "extent": "layer", "dtype": "model", "packing": "",
                    "shape": ["head_dim"]} in spec["tensors"]
        else:
            assert spec[which]["kind"] == "unmapped" and "m.kvm:6:" in spec["reason"] and reason in spec["reason"]
    for text, message in ((head.replace("or zeros", "or ones") + next(iter(cases)), "or zeros"),
                          (head + "store k as residual(other[layer]) then quant(4, group = 32, along channel)\n",
                           "one vector per KV head")):
        path.write_text(text)
        with pytest.raises(KvmError, match=message):
            check_file(path)


def test_a_rotated_operand_keeps_no_residual_window(tmp_path):
    """`rotate(...) then quant(...) except last n` does not lower, and says why at the store's line: the
    window's rows would be in the model's basis, the codes in the rotated one."""
    path = tmp_path / "m.kvm"
    path.write_text("method m : quantization\n\n"
                    "store k as rotate(hadamard, along channel) then quant(4, mode = asymmetric, group = 32, "
                    "along channel) except last 64\n")
    spec = kv_spec.derive(check_file(path), None).to_json()
    assert spec["keys"]["kind"] == "unmapped" and "m.kvm:3:1" in spec["reason"]
    assert "no residual window" in spec["reason"]


def test_summaries_of_keys_written_a_block_at_a_time_fold_max_min_and_sum_only(tmp_path):
    """Page summaries over KIVI keys (groups along key, `except last`) lower as max, min or sum (the store folds
    each row in as it is stored: a block's codes come when it is full); a mean, which would need each page's
    count, does not, and says why at its line."""
    path = tmp_path / "m.kvm"
    head = ("method m : quantization\n\nparam page_size: tokens = 32 in [1, 1024]\n"
            "store k as quant(2, mode = asymmetric, group = page_size, along key) except last 128\n"
            "dim pages = split(key, size = page_size)\n")
    path.write_text(head + "summary kmax = max(k, within pages)\nsummary ksum = sum(k, within pages)\n")
    spec = kv_spec.derive(check_file(path), None).to_json()
    assert spec["reason"] is None and [s["tensor"] for s in spec["summaries"]] == ["kmax", "ksum"]
    path.write_text(head + "summary kmean = mean(k, within pages)\n")
    spec = kv_spec.derive(check_file(path), None).to_json()
    assert "m.kvm:6:1: summary kmean: k is written a block at a time" in spec["reason"]


def test_deltakv_one_code_for_keys_and_values_in_some_layers():
    """DeltaKV's `store k, v as residual(nearest(...)) then project(...) except first sink + last recent where
    layer not in full_layers` maps to one `delta` encoding of both operands: per token its code share and its
    neighbours' positions, per page its centers' raw keys and values, per sequence the raw sinks and window,
    per layer the projections over a head's 2 x head_dim channels; the manifest lists its inputs (which
    `kvc calibrate` trains). It lowers, hooks and all (tests/methods/test_deltakv.py serves it)."""
    data = manifest("deltakv")
    assert data["lowered"] and data["kv_spec"]["reason"] is None
    # a compressed layer's slot: its code share (64 bf16 channels of 2 x 128 at ratio 0.25), its share of the
    # neighbours, and a page's centers (every 8th slot's raw 2 x 128 bf16) spread over the page; a full layer's: K and V
    import importlib

    hooks = importlib.import_module("kvc.kernels_generated.deltakv.hooks")
    values = check_file(METHODS_DIR / "deltakv.kvm").values
    slots = [hooks.slot_bytes(layer, kv_heads=4, head_dim=128, dtype_bytes=2, params=values) for layer in range(4)]
    # full_layers [0, 1, 2, 8, 18]; a compressed layer's 4 neighbours shared out over the 4 KV heads: one int32 each
    assert slots == [512, 512, 512, 64 * 2 + 4 + 2 * 128 * 2 / 8]
    assert data["kv_spec"]["layers"] == {w: {"param": "full_layers", "member": False} for w in "kv"}
    assert set(data["inputs"]) == {"down", "up", "bias"} and data["inputs"]["down"]["file"] == "deltakv.safetensors"
    spec = data["kv_spec"]
    assert spec["keys"] == spec["values"] and spec["keys"]["kind"] == "delta"
    enc = spec["keys"]
    assert (enc["every"], enc["count"], enc["sink"], enc["recent"]) == ("stride", "neighbours", "sink", "recent")
    assert enc["layers"] == {"param": "full_layers", "member": False} and enc["prerope"] and enc["bias"] == "bias"
    tensors = {t["name"]: (t["extent"], t["dtype"], t["shape"]) for t in spec["tensors"]}
    assert tensors == {
        "kv_latent": ("token", "model", ["floor(2*head_dim*ratio + 1/2)"]),
        "kv_neighbours": ("token", "int32", ["ceiling(neighbours/kv_heads)"]),  # shared out over the KV heads
        "kv_centers": ("page", "model", ["page_size/stride", "2*head_dim"]),
        "kv_sinks": ("seq", "model", ["sink", "2*head_dim"]),
        "kv_window": ("seq", "model", ["2*recent", "2*head_dim"]),
        "down": ("layer", "model", ["2*head_dim", "kv_group*floor(2*head_dim*ratio + 1/2)"]),
        "up": ("layer", "model", ["2*head_dim", "kv_group*floor(2*head_dim*ratio + 1/2)"]),
        "bias": ("layer", "model", ["2*head_dim"]),
    }


def test_stores_for_some_layers_name_their_layers_or_say_why(tmp_path):
    """`where layer in P` maps (the manifest's `layers`, and the generated `dense_operands` names the
    operands a layer stores dense); other conditions are unmapped with their position."""
    path = tmp_path / "m.kvm"
    path.write_text("method m : quantization\nparam firsts: int[] = [0, 1]\n"
                    "store k as quant(2, group = 32, along channel) where layer in firsts\n")
    spec = kv_spec.derive(check_file(path), None).to_json()
    assert spec["keys"]["kind"] == "quantized" and spec["reason"] is None
    assert spec["layers"] == {"k": {"param": "firsts", "member": True}}
    path.write_text("method m : quantization\nparam firsts: int[] = [0, 1]\n"
                    "store k as quant(2, group = 32, along channel) where layer > 1\n")
    spec = kv_spec.derive(check_file(path), None).to_json()
    assert spec["keys"]["kind"] == "unmapped" and "m.kvm:3:54" in spec["reason"]
    assert "take `layer in P` or `layer not in P`" in spec["reason"]
    namespace: dict = {}
    exec(kv_spec.emit_python(kv_spec.derive(check_file(METHODS_DIR / "kivi.kvm"), None), "kivi", "kivi.kvm"),
         {"math": math, "torch": torch}, namespace)
    assert namespace["dense_operands"]({"dense_layers": [0, 3]}, 3) == ("k", "v")
    assert namespace["dense_operands"]({"dense_layers": [0, 3]}, 1) == ()
    text = (METHODS_DIR / "deltakv.kvm").read_text().replace("where layer not in full_layers", "where layer > 2")
    path = tmp_path / "deltakv.kvm"
    path.write_text(text)
    spec = kv_spec.derive(check_file(path), None).to_json()
    assert spec["keys"]["kind"] == "unmapped" and "take `layer in P` or `layer not in P`" in spec["reason"]


def test_fp8_float_codes_and_a_scale_per_layer():
    """fp8 lowers: FP8 codes per token, one scale per layer (LAYER extent) for K and for V, half the
    bytes of bf16 K/V; KIVI does not lower yet and its manifest says what the kernels lack."""
    data = manifest("fp8")
    assert data["lowered"] and data["hooks"] == {} and data["attention"]["variant"] == "spec"
    spec = data["kv_spec"]
    assert spec["reason"] is None and spec["keys"]["format"] == "param format"
    tensors = {t["name"]: t for t in spec["tensors"]}
    assert tensors["k_codes"]["dtype"] == "from format" and tensors["k_scale"]["extent"] == "layer"
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        built = generated_kv_spec("fp8", {"format": fmt, "scale": "dynamic"})(8, 128, torch.bfloat16, 16)
        assert built.keys == Quantized("k_codes", "k_scale", 8, 128, format=fmt, scaling="dynamic", shared_heads=True)
        assert built.tensor("v_codes") == TensorSpec("v_codes", Extent.TOKEN, dtype, (128,))
        assert built.tensor("v_scale") == TensorSpec("v_scale", Extent.LAYER, torch.bfloat16, (1,))
        assert built.bytes_per_token(8) * 2 == 8 * 2 * 128 * 2
        assert built.bytes_per_page(8, 16) == 16 * built.bytes_per_token(8)
    kivi = manifest("kivi")
    assert kivi["lowered"] and kivi["hooks"] == {} and kivi["attention"]["variant"] == "spec"


def test_fp8_scales_along_other_axes_do_not_fit(tmp_path):
    from kvc.compiler import kv_spec
    from kvc.dsl import check_file

    path = tmp_path / "m.kvm"
    path.write_text("method m : quantization\nstore k as fp8(e4m3, along channel)\n")
    spec = kv_spec.derive(check_file(path), None)
    assert "fp8 scales shared along channel" in spec.to_json()["reason"]


def test_the_summaries_of_a_cluster_index_are_no_spec_tensors():
    """RetroInfer's cluster summaries live in the engine's cluster index (hook fact `clusters`), not in
    the pages: its spec is full's, with nothing left unexplained."""
    spec = manifest("retroinfer")["kv_spec"]
    assert spec.get("reason") is None and [t["name"] for t in spec["tensors"]] == ["k", "v"]
    assert not spec["summaries"]


def test_a_shared_selection_chosen_each_step_stores_nothing():
    """OmniKV's `shared chosen` is chosen anew in every decode step (hook fact `tokens`): its spec is full's."""
    spec = manifest("omnikv")["kv_spec"]
    assert spec.get("reason") is None and [t["name"] for t in spec["tensors"]] == ["k", "v"]


QUANTIZED_EVICTION = """method {name} : eviction

param budget: tokens = 64 in [1, 1048576]

store v as quant(8, mode = symmetric, group = 32, along channel) except last 16

on prefill_end:
  keep first 4 + last budget
"""


def test_a_lowered_method_serves_its_quantized_spec(tmp_path, monkeypatch):
    """The generated `kv_spec` of a lowered method that stores V quantized (symmetric 8-bit: int8
    codes, no zero point), through `resolve_method` as the engine gets it."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "qevict.kvm"
    path.write_text(QUANTIZED_EVICTION.format(name="qevict"))
    assert "def kv_spec(" in codegen.generate(path)["hooks.py"]
    spec = resolve_method(str(path), None).kv_spec(2, 64, torch.float16, 16)
    assert spec.keys == Dense("k")
    assert spec.values == Quantized("v_codes", "v_scale", 8, 32, residual="v_resid", axis="channel",
                                    prefill_exact=True)
    assert spec.tensor("v_codes") == TensorSpec("v_codes", Extent.TOKEN, torch.int8, (64,))
    assert spec.tensor("v_scale") == TensorSpec("v_scale", Extent.TOKEN, torch.float16, (2,))
    assert spec.tensor("v_resid") == TensorSpec("v_resid", Extent.SEQ, torch.float16, (17, 64))  # 16 and the step's
    assert "v_zero" not in spec and not spec.dense


IN_PLACE = """method {name} : eviction

param budget: tokens = 64 in [1, 1048576]
{store}
on step_end:
  keep first 4 + last budget
{read}"""
PAGE_READ = """
dim pages = split(key, size = 16)
summary kmax = max(k, within pages)

on decode_before_attention:
  read top(max(sum(q * kmax, over channel), over group), budget, per kv_head)
"""


@pytest.mark.parametrize("store,read,positions", [
    ("", "", True),  # a decode-time keep over dense K/V: it evicts in place
    ("store v as fp8(e4m3, scale = unit, along kv_head, key, channel)", "", True),  # codes move slot by slot
    ("store k as quant(2, group = 16, along key) except last 16", "", False),  # per-page scales, residual window
    ("", PAGE_READ, False),  # a read's newest page is where tokens were appended
])
def test_which_decode_keeps_evict_in_place(tmp_path, store, read, positions):
    """The spec stores each slot's position (`positions`: its keeps evict in place) only where every slot
    moves alone and nothing reads slots by where they were appended."""
    path = tmp_path / "mine.kvm"
    path.write_text(IN_PLACE.format(name="mine", store=store, read=read))
    manifest = json.loads(codegen.generate(path)["manifest.json"])
    spec = manifest["kv_spec"]
    assert manifest["lowered"], manifest.get("reason")
    assert spec["positions"] == ("slot.position" if positions else None)
    assert any(t["name"] == "slot.position" for t in spec["tensors"]) is positions
