//! Tokens of the SQL filter language, each with the byte offset where it starts.

use super::{MAX_EXPRESSION_LEN, SqlError};

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
    /// A regular identifier (keywords included; the parser decides).
    Word(String),
    /// A `[delimited]` or `"quoted"` identifier: never a keyword.
    Quoted(String),
    Str(String),
    Int(i64),
    Num(f64),
    Sym(&'static str),
    End,
}

#[derive(Clone, Debug)]
pub(super) struct Token {
    pub(super) tok: Tok,
    pub(super) at: usize,
}

const SYMBOLS: [&str; 17] =
    ["<>", "!=", "<=", ">=", "=", "<", ">", "+", "-", "*", "/", "%", "(", ")", ",", ".", ";"];

pub(super) fn tokens(text: &str) -> Result<Vec<Token>, SqlError> {
    if text.len() > MAX_EXPRESSION_LEN {
        return Err(SqlError::new(
            MAX_EXPRESSION_LEN,
            format!("the expression is longer than {MAX_EXPRESSION_LEN} bytes"),
        ));
    }
    let mut out = Vec::new();
    let mut it = text.char_indices().peekable();
    while let Some(&(at, c)) = it.peek() {
        if c.is_whitespace() {
            it.next();
            continue;
        }
        let tok = if c.is_alphabetic() || c == '_' {
            let mut word = String::new();
            while let Some(&(_, c)) = it.peek() {
                if c.is_alphanumeric() || c == '_' {
                    word.push(c);
                    it.next();
                } else {
                    break;
                }
            }
            Tok::Word(word)
        } else if c.is_ascii_digit() {
            number(text, at, &mut it)?
        } else if c == '\'' {
            Tok::Str(quoted(&mut it, at, '\'', '\'', "string")?)
        } else if c == '"' {
            Tok::Quoted(quoted(&mut it, at, '"', '"', "quoted identifier")?)
        } else if c == '[' {
            Tok::Quoted(quoted(&mut it, at, '[', ']', "delimited identifier")?)
        } else if let Some(sym) = SYMBOLS.iter().find(|s| text[at..].starts_with(**s)) {
            for _ in 0..sym.len() {
                it.next();
            }
            Tok::Sym(sym)
        } else {
            return Err(SqlError::new(at, format!("unexpected character {c:?}")));
        };
        out.push(Token { tok, at });
    }
    out.push(Token { tok: Tok::End, at: text.len() });
    Ok(out)
}

/// A run of characters between `open` and `close`, where a doubled `close` stands for itself.
fn quoted(
    it: &mut std::iter::Peekable<std::str::CharIndices<'_>>,
    at: usize,
    open: char,
    close: char,
    what: &str,
) -> Result<String, SqlError> {
    debug_assert_eq!(it.peek().map(|p| p.1), Some(open));
    it.next();
    let mut s = String::new();
    loop {
        match it.next() {
            None => return Err(SqlError::new(at, format!("unterminated {what}"))),
            Some((_, c)) if c == close => {
                if it.peek().map(|p| p.1) == Some(close) {
                    it.next();
                    s.push(close);
                } else {
                    return Ok(s);
                }
            }
            Some((_, c)) => s.push(c),
        }
    }
}

/// `123` (an integer), `1.5`, `1.` and `1.5E-3` (numbers).
fn number(
    text: &str,
    at: usize,
    it: &mut std::iter::Peekable<std::str::CharIndices<'_>>,
) -> Result<Tok, SqlError> {
    let mut end = at;
    let mut float = false;
    let mut seen_dot = false;
    let mut seen_exp = false;
    while let Some(&(i, c)) = it.peek() {
        let take = if c.is_ascii_digit() {
            true
        } else if c == '.' && !seen_dot && !seen_exp {
            seen_dot = true;
            true
        } else if (c == 'e' || c == 'E') && !seen_exp {
            // An exponent needs digits after it (and an optional sign).
            let rest = &text[i + 1..];
            let digits = rest.strip_prefix(['+', '-']).unwrap_or(rest);
            if digits.starts_with(|d: char| d.is_ascii_digit()) {
                seen_exp = true;
                if rest.len() != digits.len() {
                    it.next();
                }
                true
            } else {
                false
            }
        } else {
            false
        };
        if !take {
            break;
        }
        float |= c == '.' || c == 'e' || c == 'E';
        it.next();
        end = it.peek().map_or(text.len(), |p| p.0);
    }
    let literal = &text[at..end];
    if float {
        literal
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .map(Tok::Num)
            .ok_or_else(|| SqlError::new(at, format!("number {literal} is out of range")))
    } else {
        literal
            .parse::<i64>()
            .map(Tok::Int)
            .map_err(|_| SqlError::new(at, format!("integer {literal} is out of range")))
    }
}
