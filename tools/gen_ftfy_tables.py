#!/usr/bin/env python3
"""Writes the data tables of MegaSlide's port of ftfy.fix_text (src/model/ftfy_fix_text.cpp) from the ftfy
package itself, so the C++ follows the installed ftfy's tables exactly:

    python tools/gen_ftfy_tables.py      # with ftfy 6.3.1 (tools/fixtures-requirements.txt) installed

writes src/model/ftfy_tables.inc (the single-byte codecs ftfy tries, its character classes, the badness
expression's alternatives as sequences of those classes, the character-wise fixes) and
src/model/ftfy_html_entities.inc (the entity table of ftfy's own unescape_html). The character classes
are the sets Python's `re` matches (\\s, \\w, \\d on str included), expanded to code point ranges; the
script checks its reading of the two str expressions it takes apart (the badness expression and the
UTF-8 detector) against `re` itself on random strings before writing anything.
"""

import bisect
import codecs
import random
import re
import re._constants as sre_c
import re._parser as sre_parse
import sys
import unicodedata

import ftfy
import ftfy.bad_codecs  # noqa: F401  (registers the sloppy codecs and utf-8-variants)
from ftfy import badness, chardata, fixes

MAX_CP = 0x10FFFF
OUT = "src/model/ftfy_tables.inc"
OUT_ENTITIES = "src/model/ftfy_html_entities.inc"


# ---- code point sets as sorted, merged [first, last] ranges -------------------------------------

def merge(ranges):
    out = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(r) for r in out]


def complement(ranges):
    out, prev = [], 0
    for a, b in ranges:
        if a > prev:
            out.append((prev, a - 1))
        prev = b + 1
    if prev <= MAX_CP:
        out.append((prev, MAX_CP))
    return out


def brute_force(pattern):
    """The code points a one-character str expression matches, found by trying every one."""
    rx = re.compile(pattern)
    cps = [c for c in range(MAX_CP + 1) if rx.fullmatch(chr(c))]
    return merge((c, c) for c in cps)


CATEGORY_SETS = {sre_c.CATEGORY_SPACE: r"\s", sre_c.CATEGORY_WORD: r"\w", sre_c.CATEGORY_DIGIT: r"\d",
                 sre_c.CATEGORY_NOT_SPACE: r"\S", sre_c.CATEGORY_NOT_WORD: r"\W", sre_c.CATEGORY_NOT_DIGIT: r"\D"}
_category_cache = {}


def category_ranges(cat):
    if cat not in _category_cache:
        _category_cache[cat] = brute_force(CATEGORY_SETS[cat])
    return _category_cache[cat]


def in_ranges(items):
    """The set a parsed character class ([...]) matches."""
    negate, ranges = False, []
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            ranges.append((av, av))
        elif op is sre_c.RANGE:
            ranges.append(av)
        elif op is sre_c.CATEGORY:
            ranges.extend(category_ranges(av))
        else:
            raise ValueError(f"unexpected class item {op}")
    ranges = merge(ranges)
    return complement(ranges) if negate else ranges


def element_ranges(op, av):
    """The set one parsed single-character element matches."""
    if op is sre_c.LITERAL:
        return [(av, av)]
    if op is sre_c.NOT_LITERAL:
        return complement([(av, av)])
    if op is sre_c.IN:
        return in_ranges(av)
    if op is sre_c.ANY:  # '.' without DOTALL: anything but '\n'
        return complement([(10, 10)])
    raise ValueError(f"unexpected element {op}")


def contains(ranges, c):
    i = bisect.bisect_right(ranges, (c, MAX_CP + 1)) - 1
    return i >= 0 and ranges[i][0] <= c <= ranges[i][1]


class SetTable:
    """Distinct sets, numbered in order of first use."""

    def __init__(self):
        self.sets, self.index, self.names = [], {}, {}

    def add(self, ranges, name=None):
        key = tuple(ranges)
        if key not in self.index:
            self.index[key] = len(self.sets)
            self.sets.append(list(ranges))
        if name:
            self.names[name] = self.index[key]
        return self.index[key]


# ---- the badness expression as alternatives of single-character steps ---------------------------

TOKEN_CHAR, TOKEN_OPTIONAL, TOKEN_START = 0, 1, 2


def badness_branches(sets):
    tree = sre_parse.parse(badness.BADNESS_RE.pattern, badness.BADNESS_RE.flags)
    assert len(tree.data) == 1 and tree.data[0][0] is sre_c.BRANCH
    branches = []
    for sub in tree.data[0][1][1]:
        tokens = []
        for op, av in sub.data:
            if op is sre_c.AT:
                assert av is sre_c.AT_BEGINNING
                tokens.append((TOKEN_START, 0))
            elif op is sre_c.MAX_REPEAT:
                lo, hi, inner = av
                assert (lo, hi) == (0, 1) and len(inner.data) == 1
                tokens.append((TOKEN_OPTIONAL, sets.add(element_ranges(*inner.data[0]))))
            else:
                tokens.append((TOKEN_CHAR, sets.add(element_ranges(op, av))))
        branches.append(tokens)
    return branches


def python_is_bad(text, branches, sets):
    """is_bad through the tables, as the C++ does it (checked against ftfy's own)."""
    def match(tokens, k, i):
        if k == len(tokens):
            return True
        kind, s = tokens[k]
        if kind == TOKEN_START:
            return i == 0 and match(tokens, k + 1, i)
        hit = i < len(text) and contains(sets.sets[s], ord(text[i]))
        if kind == TOKEN_OPTIONAL:
            return (hit and match(tokens, k + 1, i + 1)) or match(tokens, k + 1, i)
        return hit and match(tokens, k + 1, i + 1)
    return any(match(b, 0, i) for i in range(len(text) + 1) for b in branches)


def clue_set(name):
    parsed = sre_parse.parse("[" + chardata.UTF8_CLUES[name] + "]", re.VERBOSE)
    assert len(parsed.data) == 1
    return element_ranges(*parsed.data[0])


def python_utf8_detector_spans(text, first2, first3, first4, cont, strict):
    """UTF8_DETECTOR_RE.finditer's spans through the tables, as the C++ does it."""
    def at(i, s):
        return i < len(text) and contains(s, ord(text[i]))

    spans, i = [], 0
    while i < len(text):
        if i > 0 and contains(strict, ord(text[i - 1])):
            i += 1
            continue
        j = i
        while True:
            if at(j, first2) and at(j + 1, cont):
                j += 2
            elif at(j, first3) and at(j + 1, cont) and at(j + 2, cont):
                j += 3
            elif at(j, first4) and all(at(j + k, cont) for k in (1, 2, 3)):
                j += 4
            else:
                break
        if j > i:
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


# ---- codecs ---------------------------------------------------------------------------------------

def decode_table(encoding):
    table = [ord(c) for c in bytes(range(256)).decode(encoding)]
    assert len(table) == 256
    return table


def check_possible_encoding(encoding, table):
    """ftfy's possible_encoding(text, encoding) is 'every character is one the codec decodes to'."""
    image = set(table)
    for c in list(range(0x2600)) + [0xFFFD, 0xF8FF]:
        assert chardata.possible_encoding(chr(c), encoding) == (c in image), (encoding, hex(c))
        if c in image:
            assert chr(c).encode(encoding) == bytes([table.index(c)])


def c_string(text):
    out = []
    for b in text.encode("utf-8"):
        out.append(chr(b) if 0x20 <= b < 0x7F and chr(b) not in '"\\?' else f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def main():
    assert ftfy.__version__ == "6.3.1", f"ftfy {ftfy.__version__}: the tables are for 6.3.1"
    header = (f"Generated by tools/gen_ftfy_tables.py from ftfy {ftfy.__version__} with Python "
              f"{sys.version.split()[0]} (Unicode {unicodedata.unidata_version}); do not edit.")
    sets = SetTable()

    # Badness and its self-check.
    branches = badness_branches(sets)
    rng = random.Random(6301)
    pool = sorted({c for s in sets.sets for a, b in s if b - a < 400 for c in range(a, b + 1)})
    pool += [ord(c) for c in "abcXYZ .,?!_\n\t0123456789"] + [0x4E2D, 0x1F600, 0x0410, 0x03B1]
    for trial in range(40000):
        text = "".join(chr(rng.choice(pool)) for _ in range(rng.randint(1, 8)))
        assert python_is_bad(text, branches, sets) == badness.is_bad(text), repr(text)

    # The UTF-8 detector's classes and its self-check.
    first2 = sets.add(clue_set("utf8_first_of_2"), "kUtf8FirstOf2")
    first3 = sets.add(clue_set("utf8_first_of_3"), "kUtf8FirstOf3")
    first4 = sets.add(clue_set("utf8_first_of_4"), "kUtf8FirstOf4")
    cont = sets.add(clue_set("utf8_continuation"), "kUtf8Continuation")
    strict = sets.add(clue_set("utf8_continuation_strict"), "kUtf8ContinuationStrict")
    clue_sets = [sets.sets[i] for i in (first2, first3, first4, cont, strict)]
    pool2 = sorted({c for s in clue_sets for a, b in s for c in range(a, b + 1)}) + [ord(c) for c in "ab \n"]
    for trial in range(40000):
        text = "".join(chr(rng.choice(pool2)) for _ in range(rng.randint(1, 12)))
        expected = [m.span() for m in chardata.UTF8_DETECTOR_RE.finditer(text)]
        assert python_utf8_detector_spans(text, *clue_sets) == expected, repr(text)

    sets.add(category_ranges(sre_c.CATEGORY_DIGIT), "kPythonDigit")  # \d of fixes.ANSI_RE

    # Codecs: ftfy's CHARMAP_ENCODINGS in its order, then plain windows-1252 (its latin-1 -> windows-1252
    # step), holes marked 0xFFFFFFFF.
    tables = []
    for encoding in chardata.CHARMAP_ENCODINGS:
        table = decode_table(encoding)
        check_possible_encoding(encoding, table)
        tables.append((encoding, table))
    strict_1252 = [ord(c) for c in bytes(range(256)).decode("windows-1252", errors="replace")]
    strict_1252 = [0xFFFFFFFF if c == 0xFFFD else c for c in strict_1252]
    tables.append(("windows-1252", strict_1252))
    assert "windows-1252" not in chardata.CHARMAP_ENCODINGS  # so ftfy's "already windows-1252" test never holds

    # fix_latin_ligatures, fix_character_width and uncurl_quotes composed (each maps characters one by one).
    translate = []
    for c in range(MAX_CP + 1):
        ch = chr(c)
        fixed = fixes.uncurl_quotes(fixes.fix_character_width(fixes.fix_latin_ligatures(ch)))
        if fixed != ch:
            translate.append((c, fixed))
    control = merge((c, c) for c in chardata.CONTROL_CHARS)
    for c in range(0x3000):  # remove_control_chars is exactly these ranges
        assert (fixes.remove_control_chars(chr(c)) == "") == contains(control, c)

    lines = [f"// ftfy.fix_text's tables. {header}", "// Included by src/model/ftfy_fix_text.cpp only.", ""]
    lines.append("// chardata.CHARMAP_ENCODINGS in ftfy's order, then strict windows-1252: byte -> code point.")
    lines.append(f"constexpr int kCharmapCount = {len(tables) - 1};")
    lines.append(f"constexpr int kWindows1252 = {len(tables) - 1};")
    lines.append("constexpr const char* kCharmapNames[] = {" + ", ".join(f'"{e}"' for e, _ in tables) + "};")
    lines.append("constexpr uint32_t kCharmaps[][256] = {")
    for encoding, table in tables:
        lines.append(f"  {{  // {encoding}")
        for row in range(0, 256, 8):
            lines.append("    " + " ".join(f"0x{c:X}," for c in table[row:row + 8]))
        lines.append("  },")
    lines.append("};")
    lines.append("")
    lines.append("// Character classes (the code points Python's re matches), as ranges.")
    flat, spans = [], []
    for s in sets.sets:
        spans.append((len(flat), len(s)))
        flat.extend(s)
    lines.append("constexpr CodeRange kSetRanges[] = {")
    for k in range(0, len(flat), 6):
        lines.append("  " + " ".join(f"{{0x{a:X}, 0x{b:X}}}," for a, b in flat[k:k + 6]))
    lines.append("};")
    lines.append("constexpr SetSpan kSets[] = {" + ", ".join(f"{{{a}, {n}}}" for a, n in spans) + "};")
    for name, index in sets.names.items():
        lines.append(f"constexpr int {name} = {index};")
    lines.append("")
    lines.append(f"// badness.BADNESS_RE: {len(branches)} alternatives, each a sequence of steps (one character of a class,")
    lines.append("// an optional one, or the start of the text).")
    flat_tokens, branch_spans = [], []
    for b in branches:
        branch_spans.append((len(flat_tokens), len(b)))
        flat_tokens.extend(b)
    kinds = {TOKEN_CHAR: "kOne", TOKEN_OPTIONAL: "kOptional", TOKEN_START: "kStart"}
    lines.append("constexpr BadnessStep kBadnessSteps[] = {")
    for k in range(0, len(flat_tokens), 6):
        lines.append("  " + " ".join(f"{{BadnessStep::{kinds[t]}, {s}}}," for t, s in flat_tokens[k:k + 6]))
    lines.append("};")
    lines.append("constexpr SetSpan kBadnessBranches[] = {" + ", ".join(f"{{{a}, {n}}}" for a, n in branch_spans) + "};")
    lines.append("")
    lines.append(f"// fix_latin_ligatures, fix_character_width, uncurl_quotes composed: {len(translate)} code points.")
    lines.append("constexpr CharacterFix kCharacterFixes[] = {")
    for c, fixed in translate:
        lines.append(f"  {{0x{c:X}, {c_string(fixed)}}},")
    lines.append("};")
    lines.append("// chardata.CONTROL_CHARS (remove_control_chars).")
    lines.append("constexpr CodeRange kControlChars[] = {" + " ".join(f"{{0x{a:X}, 0x{b:X}}}," for a, b in control) + "};")
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")

    entities = sorted(chardata.HTML_ENTITIES.items(), key=lambda kv: kv[0].encode())
    lines = [f"// chardata.HTML_ENTITIES (ftfy's unescape_html): {len(entities)} references with their ';', HTML5's and",
             "// the upper-cased names ftfy adds, sorted by bytes. " + header,
             "// Included by src/model/ftfy_fix_text.cpp only."]
    lines += [f"{{{c_string(name)}, {c_string(text)}}}," for name, text in entities]
    with open(OUT_ENTITIES, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{OUT}: {len(sets.sets)} sets, {len(flat)} ranges, {len(branches)} badness alternatives, "
          f"{len(translate)} character fixes; {OUT_ENTITIES}: {len(entities)} entities")


if __name__ == "__main__":
    main()
