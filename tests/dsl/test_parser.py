"""Parser: the AST built from source, positions, comments, layout and error recovery."""

from __future__ import annotations

from kvc.dsl import ast, parse_source
from kvc.dsl.errors import DiagnosticSink
from kvc.dsl.parser import load

SRC = """# SnapKV-like
method m : eviction  # header
param budget: tokens = 2048 in [1, 65536]
param pooling: {avg, max} = avg

on prefill_end where layer >= 2:
  obs = attention(q[last 32], k)
  score = mean(pool(sum(obs, over query), pooling, 5,
                    along key), over group)  # continues over two lines
  keep top(score, budget - 32, per kv_head) + first 4 + last 32
"""


def test_structure_and_positions() -> None:
    m = parse_source(SRC).method
    header, budget, pooling, hook = m.items
    assert (header.name.name, header.family.name) == ("m", "eviction")
    assert budget.name.pos.line == 3 and budget.name.pos.col == 7
    assert budget.type == ast.TypeRef("scalar", "tokens")
    assert budget.domain == ast.Domain("range", [ast.Number(1), ast.Number(65536)])
    assert [x.name for x in pooling.type.members] == ["avg", "max"]
    assert hook.name.name == "prefill_end" and hook.where == ast.Compare(">=", ast.Name("layer"), ast.Number(2))
    keep = hook.body[2]
    assert isinstance(keep, ast.Keep) and keep.pos.line == 10 and keep.pos.col == 3
    # `+` is left-associative: (top + first 4) + last 32
    assert isinstance(keep.selection.left.left, ast.Call)
    assert keep.selection.left.right == ast.Range("first", ast.Number(4))


def test_calls_split_arguments_keywords_and_clauses() -> None:
    m = parse_source("method m : quantization\nstore k as fp8(e4m3, along kv_head, key, channel)\n"
                     "store v as quant(2, mode = symmetric, group = 32, along channel)\n").method
    fp8 = m.items[1].codecs[0]
    assert [c.kind for c in fp8.clauses] == ["along"]
    assert [d.name for d in fp8.clauses[0].dims] == ["kv_head", "key", "channel"]
    quant = m.items[2].codecs[0]
    assert [k.name.name for k in quant.kwargs] == ["mode", "group"] and quant.args == [ast.Number(2)]
    top = parse_source("method m : eviction\non replay_end:\n  keep top(s, n, per kv_head, across layer)\n").method
    clauses = top.items[1].body[0].selection.clauses
    assert [(c.kind, [d.name for d in c.dims]) for c in clauses] == [("per", ["kv_head"]), ("across", ["layer"])]


def test_precedence() -> None:
    def value(text: str) -> ast.Expr:
        return parse_source(f"method m : full\nlet x = {text}\n").method.items[1].value

    assert value("a - b - c") == ast.BinOp("-", ast.BinOp("-", ast.Name("a"), ast.Name("b")), ast.Name("c"))
    assert value("a - b * c") == ast.BinOp("-", ast.Name("a"), ast.BinOp("*", ast.Name("b"), ast.Name("c")))
    assert value("-a * b") == ast.BinOp("*", ast.UnaryOp("-", ast.Name("a")), ast.Name("b"))
    assert value("a if b else c if d else e") == ast.IfElse(ast.Name("b"), ast.Name("a"),
                                                         ast.IfElse(ast.Name("d"), ast.Name("c"), ast.Name("e")))
    assert value("not a and b") == ast.BoolOp("and", [ast.UnaryOp("not", ast.Name("a")), ast.Name("b")])
    assert value("layer not in xs") == ast.Compare("not in", ast.Name("layer"), ast.Name("xs"))
    assert value("last n * 2") == ast.BinOp("*", ast.Range("last", ast.Name("n")), ast.Number(2))


def test_equality_ignores_positions_and_layout() -> None:
    a = parse_source("method m : eviction\non step_end:\n  keep   top( s ,n,per kv_head )\n").method
    b = parse_source("method m:eviction\n\n\non step_end:\n      keep top(s, n,\n  per kv_head)\n").method
    assert a == b


def test_comments_are_collected_with_their_place() -> None:
    parsed = parse_source(SRC)
    assert [(c.line, c.own_line) for c in parsed.comments] == [(1, True), (2, False), (9, False)]
    assert parsed.comments[2].text == "# continues over two lines"


def test_literals() -> None:
    m = parse_source('method m : eviction\nreplay "a\\n\\"b\\"" in chunks of 64\nlet x = 1e-3\nlet y = [1, 2]\n').method
    assert m.items[1].prompt.value == 'a\n"b"'
    assert m.items[2].value == ast.Number(0.001)
    assert m.items[3].value == ast.ListExpr([ast.Number(1), ast.Number(2)])


def test_crlf_and_bom_are_accepted() -> None:
    a = parse_source(b"\xef\xbb\xbfmethod m : full\r\nlet x = 1\r\n").method
    assert a == parse_source("method m : full\nlet x = 1\n").method


def test_recovery_keeps_the_lines_that_parse() -> None:
    text = "method m : eviction\nparam a: int = \nparam b: tokens = 3\non step_end:\n  keep )\n  keep last b\n"
    sink = DiagnosticSink("m.kvm", text)
    parsed = load(text, "m.kvm", sink)
    assert parsed.broken and "a" in parsed.poisoned
    assert [type(d).__name__ for d in parsed.method.items] == ["Header", "Param", "Hook"]
    assert len(parsed.method.hooks[0].body) == 1
    assert sorted(d.pos.line for d in sink.items) == [2, 5]


def test_walk_visits_every_node_once() -> None:
    m = parse_source(SRC).method
    names = [n.id for n in ast.walk(m) if isinstance(n, ast.Name)]
    assert names.count("score") == 1 and "pooling" in names
