//! Text a worker wrote, made safe to show: a worker is less trusted than the parent, and its
//! words reach the parent's logs, its exceptions and, in ComfyUI, the browser.
//!
//! [`worker_text`] marks the text as the worker's (`worker says: `), replaces every control
//! character but the tab with U+FFFD (C0, DEL, C1, and the bidirectional overrides and
//! isolates that can make text read differently from what it is: "Trojan Source"), keeps line
//! breaks but indents each continuation line by four spaces (so a worker cannot forge a line
//! that reads as the parent's own log line), and bounds the result to [`MAX_SHOWN_LEN`] bytes.
//! A carriage return is a control character here: `\r\n` keeps its line break only.

/// What [`worker_text`] puts before a worker's text.
pub const WORKER_SAYS: &str = "worker says: ";

/// The most bytes [`worker_text`] returns (the marker and an ellipsis included).
pub const MAX_SHOWN_LEN: usize = 2048;

/// Whether `c` is replaced by [`worker_text`].
#[must_use]
pub fn is_unsafe_char(c: char) -> bool {
    (c.is_control() && c != '\t' && c != '\n')
        || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}')
}

/// `raw`, marked as the worker's and made safe to print: see the [module docs](self).
#[must_use]
pub fn worker_text(raw: &str) -> String {
    let mut out = String::with_capacity(WORKER_SAYS.len() + raw.len().min(MAX_SHOWN_LEN));
    out.push_str(WORKER_SAYS);
    const ELLIPSIS: &str = "…";
    let budget = MAX_SHOWN_LEN - ELLIPSIS.len();
    let raw = raw.trim_end_matches(['\n', '\r']);
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        let piece: &str = match c {
            '\r' if chars.peek() == Some(&'\n') => continue,
            '\n' => "\n    ",
            c if is_unsafe_char(c) => "\u{FFFD}",
            _ => {
                if out.len() + c.len_utf8() > budget {
                    out.push_str(ELLIPSIS);
                    return out;
                }
                out.push(c);
                continue;
            }
        };
        if out.len() + piece.len() > budget {
            out.push_str(ELLIPSIS);
            return out;
        }
        out.push_str(piece);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_text_is_marked_as_the_workers() {
        assert_eq!(
            worker_text("ValueError: bad"),
            "worker says: ValueError: bad"
        );
    }

    #[test]
    fn control_characters_are_replaced_but_tabs_are_kept() {
        let got = worker_text("a\x1b[31mred\x07\tb\u{85}c\u{7f}\rd");
        assert_eq!(
            got,
            "worker says: a\u{FFFD}[31mred\u{FFFD}\tb\u{FFFD}c\u{FFFD}\u{FFFD}d"
        );
        assert!(!got.chars().any(is_unsafe_char));
    }

    #[test]
    fn bidirectional_overrides_are_replaced() {
        assert_eq!(
            worker_text("x\u{202E}y\u{2066}z"),
            "worker says: x\u{FFFD}y\u{FFFD}z"
        );
    }

    #[test]
    fn continuation_lines_are_indented_so_they_cannot_pass_for_the_parents() {
        assert_eq!(
            worker_text("Traceback:\r\nERROR poolipc: forged\r\n"),
            "worker says: Traceback:\n    ERROR poolipc: forged"
        );
    }

    #[test]
    fn the_text_is_bounded() {
        let got = worker_text(&"\u{1b}".repeat(10_000));
        assert!(got.len() <= MAX_SHOWN_LEN, "{}", got.len());
        assert!(got.ends_with('…'));
        let got = worker_text(&"é".repeat(10_000));
        assert!(got.len() <= MAX_SHOWN_LEN && got.ends_with('…'));
    }
}
