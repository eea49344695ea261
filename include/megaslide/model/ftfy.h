// ftfy_fix_text(): ftfy.fix_text of ftfy 6.3.1 with its default configuration (what diffusers' Wan prompt
// cleaning calls), on UTF-8 text. The whole of it:
//
//   - the text is fixed line by line (each segment ends after a '\n'; at most 10^6 code points); from the
//     first segment holding a '<' on, ftfy's own HTML unescaping is off for the rest of the text;
//   - each segment is fixed until nothing changes: ftfy's unescape_html (the references of HTML5 that end in
//     ';', some of their upper-cased forms, numeric references), fix_encoding (mojibake: the text encoded
//     in the first of latin-1, sloppy windows-1252/1251/1250/1253/1254/1257, iso-8859-2, macroman, cp437 that
//     can hold it and decoded as UTF-8 — or ftfy's utf-8-variants: CESU-8, C0 80 — after restoring bytes A0
//     that became spaces and marking lossy sequences; only when ftfy's badness expression finds mojibake,
//     repeated while it changes the text; else mojibake inside other text, latin-1 read as windows-1252, C1
//     controls as windows-1252), fix_c1_controls, fix_latin_ligatures, fix_character_width, uncurl_quotes,
//     fix_line_breaks, fix_surrogates, remove_terminal_escapes, remove_control_chars, NFC.
//
// The tables (codecs, character classes, entity names, character fixes) are generated from ftfy itself by
// tools/gen_ftfy_tables.py; \s, \w and \d of its expressions are Python's. NFC is ICU's (its Unicode
// version, where Python 3.11's is 14.0). Input that is not UTF-8: a byte that does not start a complete
// sequence is read as the code point of its value; a UTF-8-encoded surrogate (ED A0 80…) is a surrogate
// code point, as in a Python str, and fix_surrogates pairs or replaces it. The output is UTF-8.
// Pure functions: any thread.
#pragma once

#include <string>

namespace megaslide {

std::string ftfy_fix_text(const std::string& text);

// ftfy.badness.is_bad: whether ftfy's heuristic sees mojibake in the text.
bool ftfy_is_bad(const std::string& text);

}  // namespace megaslide
