"""Malformed method files: each gives the expected message at the expected line and column.

Every case is checked through `check_source`, so syntax, name, type, shape, hook, parameter,
budget and family errors all travel the same path a user's `kvc check` does. A case passes when
one diagnostic has exactly the expected position and contains the expected text.
"""

from __future__ import annotations

import pytest

from kvc.dsl import KvmError, check_source

# Five lines every case starts from: a valid header and parameters (the error is after them).
PRE = (
    "method m : eviction\n"                       # 1
    "param budget: tokens = 2048 in [1, 65536]\n"  # 2
    "param window: tokens = 32 in [1, 1024]\n"     # 3
    "param kernel: int = 5 in [1, 63]\n"           # 4
    "state seen: [kv_head, key] = 0\n"             # 5
)
KEEP = "on prefill_end:\n  keep last window\n"  # a valid hook, so the family check stays quiet
SCORE = "mean(mean(attention(q[last window], k), over query), over group)"

CASES = [
    # ---- syntax -----------------------------------------------------------------------------
    ("missing colon", PRE + "param x int = 3\n" + KEEP, 6, 9, "unexpected name 'int'; expected ':'"),
    ("misspelled keyword", PRE + "parm x: int = 3\n" + KEEP, 6, 1, "did you mean 'param'"),
    ("missing expression", PRE + "param x: int =\n" + KEEP, 6, 15, "unexpected end of line; expected an expression"),
    ("unclosed bracket", PRE + "on prefill_end:\n  keep top(seen, budget\n", 7, 11, "'(' is never closed"),
    ("unmatched closer", PRE + "on prefill_end:\n  keep last window)\n", 7, 19, "unmatched ')'"),
    ("mismatched brackets", PRE + "on prefill_end:\n  keep top(seen, [1, 2), per kv_head]\n", 7, 23,
     "')' does not match '[' opened at 7:18"),
    ("unterminated string", PRE + 'replay "Repeat\n' + KEEP, 6, 8, "unterminated string"),
    ("unknown escape", PRE + 'replay "a\\q" in chunks of 64\n' + KEEP, 6, 10, "unknown escape '\\q'"),
    ("stray character", PRE + "on prefill_end:\n  keep last window $\n", 7, 20, "unexpected character '$'"),
    ("tab", PRE + "on prefill_end:\n\tkeep last window\n", 7, 1, "tab character"),
    ("control character", PRE + "on prefill_end:\n  keep last\x00 window\n", 7, 12, "control character U+0000"),
    ("hook on one line", PRE + "on prefill_end: keep last window\n", 6, 17,
     "a hook's statements go on the lines below"),
    ("unterminated block at end of file", PRE + "on prefill_end:\n", 6, 16, "expected an indented block"),
    ("unterminated block before a declaration", PRE + "on prefill_end:\nparam x: int = 1\n" + KEEP, 6, 16,
     "expected an indented block"),
    ("inconsistent indentation", PRE + "on prefill_end:\n    keep last window\n  keep first 4\n", 8, 3,
     "inconsistent indentation"),
    ("indented declaration", PRE + "  param x: int = 1\n" + KEEP, 6, 3, "unexpected indentation"),
    ("keyword argument after a clause", PRE + "on prefill_end:\n  keep top(seen, budget, per kv_head, at_least = 3)\n",
     7, 48, "unexpected '='; expected ')' or ',' `name = value` arguments come before"),
    ("positional after keyword", PRE + "on prefill_end:\n  keep top(seen, at_least = 3, budget)\n", 7, 32,
     "positional argument after a keyword argument"),
    ("clause in a subscript", PRE + "on prefill_end:\n  x = q[last window over query]\n" + "  keep last window\n",
     7, 21, "'over' cannot appear in a subscript"),
    ("statement too long", PRE + "let x = " + "1 + " * 600 + "1\n" + KEEP, 6, 1, "statement too long (2409 characters"),
    ("expression nested too deeply", PRE + "let x = " + "-" * 100 + "1\n" + KEEP, 6, 73,
     "expression nested too deeply"),
    ("brackets nested too deeply", PRE + "let x = " + "(" * 40 + "1" + ")" * 40 + "\n" + KEEP, 6, 41,
     "brackets nested more than 32 deep"),
    # ---- files ------------------------------------------------------------------------------
    ("empty file", "", 1, 1, "empty file"),
    ("blank file", "\n   \n\n", 1, 1, "empty file"),
    ("comments only", "# nothing here\n", 1, 1, "missing the method header"),
    ("non-UTF-8 bytes", (PRE + "# caf\xe9\n" + KEEP).encode("latin-1"), 6, 6, "invalid UTF-8 byte 0xe9"),
    ("10 MB file", b"# " + b"x" * (10 * 1024 * 1024) + b"\n", 1, 1, "file is too large"),
    # ---- header and declarations ------------------------------------------------------------
    ("missing header", "param budget: tokens = 3\n", 1, 1, "missing the method header"),
    ("header not first", "param budget: tokens = 3\nmethod m : eviction\n" + KEEP.replace("window", "budget"), 2, 1,
     "the method header must come first"),
    ("second header", PRE + "method other : sparse\n" + KEEP, 6, 1, "a file describes one method"),
    ("unknown family", PRE.replace("eviction", "evicton") + KEEP, 1, 12, "unknown family 'evicton'"),
    ("file name mismatch", PRE.replace("method m ", "method other ") + KEEP, 1, 8,
     "method 'other' is in a file named 'm.kvm'"),
    ("duplicate parameter", PRE + "param window: tokens = 8\n" + KEEP, 6, 7,
     "duplicate definition of 'window' (first at 3:7)"),
    ("duplicate across kinds", PRE + "let seen = 3\n" + KEEP, 6, 5, "duplicate definition of 'seen'"),
    ("reserved word as a name", PRE + "param last: int = 3\n" + KEEP, 6, 7, "'last' is a reserved word"),
    ("built-in as a name", PRE + "param group: int = 3\n" + KEEP, 6, 7, "'group' is built in (an axis)"),
    ("unknown type", PRE + "param x: flot = 3\n" + KEEP, 6, 10, "unknown type 'flot'"),
    ("default out of range", PRE + "param x: int = 64 in [1, 63]\n" + KEEP, 6, 16,
     "default 64 of x is outside its range [1, 63]"),
    ("default not in set", PRE + "param bits: int = 3 in {2, 4}\n" + KEEP, 6, 19,
     "default 3 of bits is not one of the allowed values"),
    ("negative token default", PRE + "param sink: tokens = -4\n" + KEEP, 6, 22, "default of sink is negative (-4)"),
    ("float for int", PRE + "param x: int = 2.5\n" + KEEP, 6, 16, "default of x must be a whole number, not float"),
    ("empty range", PRE + "param x: int = 3 in [5, 1]\n" + KEEP, 6, 18, "empty range [5, 1]"),
    ("enum default", PRE + "param pooling: {avg, max} = mean\n" + KEEP, 6, 29,
     "default 'mean' of pooling is not one of avg, max"),
    ("default uses a later parameter", PRE + "param a: tokens = b\nparam b: tokens = 3\n" + KEEP, 6, 19,
     "'b' is declared later (line 7)"),
    ("state with the query axis", PRE + "state s: [kv_head, query] = 0\n" + KEEP, 6, 20, "cannot have the query axis"),
    ("state with the layer axis", PRE + "state s: [layer, key] = 0\n" + KEEP, 6, 11, "already one per layer"),
    ("summary without a partition", PRE + "summary s = max(k, over channel)\n" + KEEP, 6, 13,
     "a summary reduces keys within a partition"),
    ("role that is not a mask", PRE + "input g: [layer, kv_head] from \"g.safetensors\"\nrole r = g\n" + KEEP, 7, 10,
     "a role is a mask over layer and kv_head"),
    ("unknown axis in a shape", PRE + "state s: [kv_haed, key] = 0\n" + KEEP, 6, 11, "unknown axis 'kv_haed'"),
    # ---- names, units and axes --------------------------------------------------------------
    ("unknown name", PRE + "on prefill_end:\n  keep last windw\n", 7, 13, "unknown name 'windw'"),
    ("unknown axis", PRE + "on prefill_end:\n  x = sum(seen, over kv_head, keys)\n  keep last window\n", 7, 31,
     "unknown axis 'keys'"),
    ("tokens minus an int", PRE + "on prefill_end:\n  keep last (budget - kernel)\n", 7, 14,
     "cannot combine tokens and int"),
    ("tokens times tokens", PRE + "on prefill_end:\n  keep last (budget * window)\n", 7, 14,
     "cannot multiply tokens by tokens"),
    ("reduce a missing axis", PRE + "on prefill_end:\n  x = sum(seen, over query)\n  keep last window\n", 7, 22,
     "[kv_head, key] has no query axis"),
    ("over group without heads", PRE + "on prefill_end:\n  x = mean(seen, over group)\n  keep last window\n", 7, 7,
     "nothing to reduce over group"),
    ("top without per or across", PRE + "on prefill_end:\n  keep top(seen, budget)\n", 7, 12,
     "the score also varies along kv_head: say `per kv_head`"),
    ("accumulate the wrong axes", PRE + "on prefill_chunk:\n  seen += sum(attn, over query)\n" + KEEP, 7, 11,
     "cannot add [head, key] into 'seen': [kv_head, key]"),
    ("keep per query head", PRE + "on prefill_end:\n" +
     "  keep top(mean(attention(q[last window], k), over query), budget, per head)\n", 7, 8,
     "`keep` needs a selection per KV head"),
    ("arithmetic on a selection", PRE + "on prefill_end:\n  keep top(seen, budget, per kv_head) * 2\n", 7, 8,
     "'*' cannot apply to a selection"),
    ("where is not a condition", PRE + "on prefill_end where layer + 1:\n  keep last window\n", 6, 22,
     "`where` needs a condition (a bool), not int"),
    ("softmax without an axis", PRE + "on prefill_end:\n  x = softmax(seen)\n  keep last window\n", 7, 7,
     "softmax needs one axis"),
    ("unknown function", PRE + "on prefill_end:\n  x = meen(seen, over key)\n  keep last window\n", 7, 7,
     "unknown function 'meen'"),
    ("too many arguments", PRE + "on prefill_end:\n  x = pool(seen, avg, kernel, 3, along key)\n  keep last window\n",
     7, 31, "too many arguments to pool"),
    ("unknown keyword argument", PRE + "on prefill_end:\n  keep top(seen, budget, atleast = 3, across kv_head)\n",
     7, 26, "top has no argument 'atleast'"),
    ("bad pooling mode", PRE + "on prefill_end:\n  x = pool(seen, mean, kernel, along key)\n  keep last window\n",
     7, 18, "'mean' is not a pooling mode; expected avg or max"),
    # ---- hooks: what they may read and do ---------------------------------------------------
    ("unknown hook", PRE + "on prefil_end:\n  keep last window\n", 6, 4, "unknown hook 'prefil_end'"),
    ("attn before attention", PRE + "on decode_before_attention:\n  x = attn\n" + KEEP, 7, 7,
     "attn is not available in decode_before_attention"),
    ("attn at prefill end", PRE + "on prefill_end:\n  x = attn\n  keep last window\n", 7, 7,
     "attn is not available in prefill_end"),
    ("bare q at prefill end", PRE + "on prefill_end:\n  x = attention(q, k)\n  keep last window\n", 7, 17,
     "prefill_end keeps only a window of queries: write q[last N]"),
    ("query window that grows", PRE + "on prefill_end:\n  x = attention(q[last (context - window)], k)\n" +
     "  keep last window\n", 7, 19, "N cannot depend on context"),
    ("step outside decode", PRE + "on prefill_end where step > 4:\n  keep last window\n", 6, 22,
     "'step' is not available in a `where` of prefill_end"),
    ("read at prefill end", PRE + "on prefill_end:\n  read last window\n  keep last window\n", 7, 3,
     "`read` cannot be used in prefill_end"),
    ("keep before attention", PRE + "on decode_before_attention:\n  keep last window\n", 7, 3,
     "`keep` cannot be used in decode_before_attention"),
    ("replay hook without replay", PRE + "on replay_chunk:\n  seen += 1\n" + KEEP, 6, 4,
     "replay_chunk needs a `replay` declaration"),
    ("duplicate hook", PRE + KEEP + KEEP, 8, 4, "duplicate hook `on prefill_end`"),
    ("assign to a parameter", PRE + "on prefill_end:\n  budget = 3\n  keep last window\n", 7, 3,
     "cannot assign to the parameter 'budget'"),
    ("accumulate a hook value", PRE + "on prefill_end:\n  x += 1\n  keep last window\n", 7, 3, "'x' is not a state"),
    ("define a value twice", PRE + "on prefill_end:\n  x = seen\n  x = seen\n  keep last window\n", 8, 3,
     "'x' is already defined at line 7"),
    ("empty later replay prompt", PRE + 'replay "again" in chunks of 512 then " " + last 8\n' + KEEP, 6, 38,
     "the later chunks' replay prompt is empty"),
    ("negative replay overlap", PRE + 'replay "again" in chunks of 512 then "more" + last (window - budget)\n' + KEEP,
     6, 53, "is negative"),
    ("layer in a per-request hook", PRE + 'replay "again" in chunks of 512\n' +
     'on replay_end:\n  keep last (window * layer)\n', 8, 23, "'layer' is not available in replay_end"),
    # ---- numbers: budgets, kernels, bits ----------------------------------------------------
    ("negative budget", PRE + "on prefill_end:\n  keep last (window - budget)\n", 7, 14,
     "`last` count is negative: -2016 tokens"),
    ("negative per-layer budget", PRE + "on prefill_end:\n  keep top(seen, budget - layer * window, per kv_head)\n",
     7, 18, "the number of tokens to select is negative"),
    ("even pooling kernel", PRE.replace("kernel: int = 5 in [1, 63]", "kernel: int = 4") +
     "on prefill_end:\n  keep top(pool(seen, avg, kernel, along key), budget, per kv_head)\n", 7, 28,
     "the pooling kernel must be odd"),
    ("segment of partial clusters", PRE + "dim clusters = kmeans(k, size = 24, segment = window)\n" + KEEP, 6, 47,
     "the segment length (32) must be a multiple of 24: whole clusters per segment"),
    ("too many bits", PRE + "store k as quant(9, group = 32, along key)\n" + KEEP, 6, 18,
     "the bit width must be 1 to 8 bits, not 9"),
    ("quantile outside 0..1", PRE + "input g: [layer, kv_head] from \"g.safetensors\"\n" +
     "role r = g < quantile(g, 1.5, over layer, kv_head)\n" + KEEP, 7, 26, "the quantile must be between 0 and 1"),
    # ---- storage formats --------------------------------------------------------------------
    ("store an unknown tensor", PRE + "store q as quant(2, group = 32, along key)\n" + KEEP, 6, 7,
     "store names what it encodes: k or v"),
    ("two formats for k", PRE + "store k as quant(2, group = 32, along key)\nstore k as fp8(e4m3, along key)\n" + KEEP,
     7, 7, "k already has a storage format"),
    ("an unknown fp8 scale", PRE + "store k as fp8(e4m3, scale = calibrated, along key, channel)\n" + KEEP, 6, 30,
     "'calibrated' is not a FP8 scale; expected unit or dynamic"),
    ("qjl first", PRE + "store k as qjl(1, along channel)\n" + KEEP, 6, 12,
     "qjl encodes the error of a previous stage"),
    ("except a top", PRE + "store k as quant(2, group = 32, along key) except top(seen, 3)\n" + KEEP, 6, 51,
     "cannot be used in store k"),
    ("quantize along queries", PRE + "store k as quant(2, group = 32, along query)\n" + KEEP, 6, 39,
     "quant works along kv_head, key, channel, not query"),
    ("k and v quantized together", PRE + "store k, v as quant(2, group = 32, along key)\n" + KEEP, 6, 10,
     "k and v are stored together only as one code"),
    ("k stored twice in one store", PRE + "store k, k as quant(2, group = 32, along key)\n" + KEEP, 6, 10,
     "k already has a storage format"),
    ("a store for a number of layers", PRE + "store k as quant(2, group = 32, along key) where layer + 1\n" + KEEP,
     6, 50, "`where` needs a condition on the layer (a bool)"),
    ("a store where a context is", PRE + "store k as quant(2, group = 32, along key) where context > 1\n" + KEEP, 6,
     50, "'context' is not available in a `where` of store k"),
    ("nearest alone", PRE + "store k as quant(nearest(every = 8, count = 4), group = 32, along key)\n" + KEEP, 6,
     18, "nearest(...) cannot be used in store k"),
    ("nearest without a count", PRE + "store k, v as residual(nearest(every = 8)) then project(d[layer], u[layer])\n"
     + KEEP, 6, 24, "nearest needs `count`"),
    # ---- what a family needs ----------------------------------------------------------------
    ("eviction without keep", PRE, 1, 12, "an eviction method needs a `keep`"),
    ("quantization without store", "method m : quantization\nparam bits: int = 2\n", 1, 12,
     "a quantization method needs a `store`"),
    ("full method that keeps", "method m : full\non step_end:\n  keep last 8\n", 3, 3,
     "a full method keeps and reads every token"),
]


@pytest.mark.parametrize("name,source,line,col,message", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(name: str, source: str | bytes, line: int, col: int, message: str) -> None:
    with pytest.raises(KvmError) as info:
        check_source(source, "m.kvm")
    found = [(d.pos.line, d.pos.col, f"{d.message} {d.hint or ''}") for d in info.value.diagnostics]
    assert any(d[0] == line and d[1] == col and message in d[2] for d in found), found


def test_there_are_at_least_forty_cases() -> None:
    assert len(CASES) >= 40


def test_all_errors_of_a_file_in_one_run() -> None:
    source = (PRE + "param x: int =\nparam y: flot = 3\n"
              "on prefill_end:\n  keep last windw\n  z = )\n  w = attn\n")
    with pytest.raises(KvmError) as info:
        check_source(source, "m.kvm")
    lines = sorted({d.pos.line for d in info.value.diagnostics})
    assert lines == [6, 7, 9, 10, 11], info.value.message


def test_rendering_shows_the_line_and_a_caret() -> None:
    with pytest.raises(KvmError) as info:
        check_source(PRE + "on prefill_end:\n  keep last windw\n", "m.kvm")
    text = info.value.message
    assert "m.kvm:7:13: error: unknown name 'windw'" in text
    assert "    7 |   keep last windw" in text
    assert "      |             ^^^^^" in text
    assert "hint: did you mean 'window'?" in text


def test_huge_input_fails_fast() -> None:
    import time

    start = time.perf_counter()
    with pytest.raises(KvmError):
        check_source(b"method m : eviction\n" + b"x" * (10 * 1024 * 1024), "m.kvm")
    assert time.perf_counter() - start < 0.5
