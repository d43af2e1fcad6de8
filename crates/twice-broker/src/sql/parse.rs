//! A recursive-descent parser from tokens to expressions and action statements.

use super::SqlError;
use super::lex::{Tok, Token, tokens};
use super::like::{LikePattern, compile_like};

/// How deep parentheses and operators may nest: deeper input is refused rather than allowed to
/// exhaust the stack.
const MAX_DEPTH: usize = 64;

/// A system property a filter can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sys {
    MessageId,
    CorrelationId,
    SessionId,
    ReplyToSessionId,
    Label,
    To,
    ReplyTo,
    ContentType,
    PartitionKey,
    ScheduledEnqueueTimeUtc,
    Size,
}

const SYSTEM: [(&str, Sys); 11] = [
    ("MessageId", Sys::MessageId),
    ("CorrelationId", Sys::CorrelationId),
    ("SessionId", Sys::SessionId),
    ("ReplyToSessionId", Sys::ReplyToSessionId),
    ("Label", Sys::Label),
    ("To", Sys::To),
    ("ReplyTo", Sys::ReplyTo),
    ("ContentType", Sys::ContentType),
    ("PartitionKey", Sys::PartitionKey),
    ("ScheduledEnqueueTimeUtc", Sys::ScheduledEnqueueTimeUtc),
    ("Size", Sys::Size),
];

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Prop {
    Sys(Sys),
    User(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arith {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Const {
    Null,
    Bool(bool),
    Long(i64),
    Double(f64),
    Str(String),
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Expr {
    Const(Const),
    Prop(Prop),
    NewId,
    Neg(Box<Expr>),
    Arith(Arith, Box<Expr>, Box<Expr>),
    Cmp(Cmp, Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Not(Box<Expr>),
    In { expr: Box<Expr>, list: Vec<Expr>, negated: bool },
    Like { expr: Box<Expr>, pattern: LikePattern, negated: bool },
    IsNull { expr: Box<Expr>, negated: bool },
    Exists(Prop),
}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Stmt {
    Set(Prop, Expr),
    Remove(Prop),
}

const KEYWORDS: [&str; 13] = [
    "AND", "OR", "NOT", "IN", "LIKE", "ESCAPE", "IS", "NULL", "EXISTS", "TRUE", "FALSE", "SET",
    "REMOVE",
];

pub(super) fn predicate(text: &str) -> Result<Expr, SqlError> {
    let mut p = Parser { toks: tokens(text)?, pos: 0, depth: 0 };
    if p.peek() == &Tok::End {
        return Err(SqlError::new(0, "the expression is empty"));
    }
    let e = p.or()?;
    p.expect_end()?;
    Ok(e)
}

pub(super) fn action(text: &str) -> Result<Vec<Stmt>, SqlError> {
    let mut p = Parser { toks: tokens(text)?, pos: 0, depth: 0 };
    let mut out = Vec::new();
    loop {
        if p.peek() == &Tok::End {
            break;
        }
        out.push(p.statement()?);
        if !p.eat_sym(";") {
            break;
        }
    }
    p.expect_end()?;
    if out.is_empty() {
        return Err(SqlError::new(0, "the action is empty: expected SET or REMOVE"));
    }
    Ok(out)
}

struct Parser {
    toks: Vec<Token>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> &Tok {
        &self.toks[self.pos].tok
    }

    fn at(&self) -> usize {
        self.toks[self.pos].at
    }

    fn bump(&mut self) -> Tok {
        let t = self.toks[self.pos].tok.clone();
        if self.pos + 1 < self.toks.len() {
            self.pos += 1;
        }
        t
    }

    fn is_kw(&self, kw: &str) -> bool {
        matches!(self.peek(), Tok::Word(w) if w.eq_ignore_ascii_case(kw))
    }

    fn eat_kw(&mut self, kw: &str) -> bool {
        let yes = self.is_kw(kw);
        if yes {
            self.bump();
        }
        yes
    }

    fn eat_sym(&mut self, sym: &str) -> bool {
        let yes = matches!(self.peek(), Tok::Sym(s) if *s == sym);
        if yes {
            self.bump();
        }
        yes
    }

    fn expect_sym(&mut self, sym: &str) -> Result<(), SqlError> {
        if self.eat_sym(sym) { Ok(()) } else { Err(self.unexpected(&format!("'{sym}'"))) }
    }

    fn expect_kw(&mut self, kw: &str) -> Result<(), SqlError> {
        if self.eat_kw(kw) { Ok(()) } else { Err(self.unexpected(kw)) }
    }

    fn expect_end(&self) -> Result<(), SqlError> {
        if self.peek() == &Tok::End { Ok(()) } else { Err(self.unexpected("the end")) }
    }

    fn unexpected(&self, wanted: &str) -> SqlError {
        let found = match self.peek() {
            Tok::Word(w) => format!("'{w}'"),
            Tok::Quoted(w) => format!("identifier [{w}]"),
            Tok::Str(s) => format!("string '{s}'"),
            Tok::Int(n) => format!("number {n}"),
            Tok::Num(x) => format!("number {x}"),
            Tok::Sym(s) => format!("'{s}'"),
            Tok::End => "the end of the expression".to_owned(),
        };
        SqlError::new(self.at(), format!("expected {wanted}, found {found}"))
    }

    fn enter(&mut self) -> Result<(), SqlError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(SqlError::new(
                self.at(),
                format!("the expression nests deeper than {MAX_DEPTH} levels"),
            ));
        }
        Ok(())
    }

    fn or(&mut self) -> Result<Expr, SqlError> {
        self.enter()?;
        let mut e = self.and()?;
        while self.eat_kw("OR") {
            e = Expr::Or(Box::new(e), Box::new(self.and()?));
        }
        self.depth -= 1;
        Ok(e)
    }

    fn and(&mut self) -> Result<Expr, SqlError> {
        let mut e = self.not()?;
        while self.eat_kw("AND") {
            e = Expr::And(Box::new(e), Box::new(self.not()?));
        }
        Ok(e)
    }

    fn not(&mut self) -> Result<Expr, SqlError> {
        if self.eat_kw("NOT") {
            self.enter()?;
            let e = Expr::Not(Box::new(self.not()?));
            self.depth -= 1;
            return Ok(e);
        }
        self.comparison()
    }

    fn comparison(&mut self) -> Result<Expr, SqlError> {
        let left = self.additive()?;
        let op = match self.peek() {
            Tok::Sym("=") => Some(Cmp::Eq),
            Tok::Sym("<>" | "!=") => Some(Cmp::Ne),
            Tok::Sym("<") => Some(Cmp::Lt),
            Tok::Sym("<=") => Some(Cmp::Le),
            Tok::Sym(">") => Some(Cmp::Gt),
            Tok::Sym(">=") => Some(Cmp::Ge),
            _ => None,
        };
        if let Some(op) = op {
            self.bump();
            let right = self.additive()?;
            return Ok(Expr::Cmp(op, Box::new(left), Box::new(right)));
        }
        if self.eat_kw("IS") {
            let negated = self.eat_kw("NOT");
            self.expect_kw("NULL")?;
            return Ok(Expr::IsNull { expr: Box::new(left), negated });
        }
        let negated = self.eat_kw("NOT");
        if self.eat_kw("IN") {
            self.expect_sym("(")?;
            let mut list = vec![self.additive()?];
            while self.eat_sym(",") {
                list.push(self.additive()?);
            }
            self.expect_sym(")")?;
            return Ok(Expr::In { expr: Box::new(left), list, negated });
        }
        if self.eat_kw("LIKE") {
            let pattern_at = self.at();
            let pattern = self.string("a pattern string after LIKE")?;
            let escape = if self.eat_kw("ESCAPE") {
                let at = self.at();
                let e = self.string("an escape string after ESCAPE")?;
                let mut chars = e.chars();
                match (chars.next(), chars.next()) {
                    (Some(c), None) => Some(c),
                    _ => {
                        return Err(SqlError::new(at, "the ESCAPE string must be one character"));
                    }
                }
            } else {
                None
            };
            let pattern = compile_like(&pattern, escape, pattern_at)?;
            return Ok(Expr::Like { expr: Box::new(left), pattern, negated });
        }
        if negated {
            return Err(self.unexpected("IN or LIKE after NOT"));
        }
        Ok(left)
    }

    fn string(&mut self, what: &str) -> Result<String, SqlError> {
        match self.peek() {
            Tok::Str(s) => {
                let s = s.clone();
                self.bump();
                Ok(s)
            }
            _ => Err(self.unexpected(what)),
        }
    }

    fn additive(&mut self) -> Result<Expr, SqlError> {
        let mut e = self.multiplicative()?;
        loop {
            let op = match self.peek() {
                Tok::Sym("+") => Arith::Add,
                Tok::Sym("-") => Arith::Sub,
                _ => return Ok(e),
            };
            self.bump();
            e = Expr::Arith(op, Box::new(e), Box::new(self.multiplicative()?));
        }
    }

    fn multiplicative(&mut self) -> Result<Expr, SqlError> {
        let mut e = self.unary()?;
        loop {
            let op = match self.peek() {
                Tok::Sym("*") => Arith::Mul,
                Tok::Sym("/") => Arith::Div,
                Tok::Sym("%") => Arith::Rem,
                _ => return Ok(e),
            };
            self.bump();
            e = Expr::Arith(op, Box::new(e), Box::new(self.unary()?));
        }
    }

    fn unary(&mut self) -> Result<Expr, SqlError> {
        if self.eat_sym("+") {
            self.enter()?;
            let e = self.unary()?;
            self.depth -= 1;
            return Ok(e);
        }
        if self.eat_sym("-") {
            self.enter()?;
            let e = match self.peek() {
                // A negative constant is folded into its literal (the digits must still fit in
                // a signed 64-bit integer).
                Tok::Int(n) => {
                    let n = *n;
                    self.bump();
                    Expr::Const(Const::Long(-n))
                }
                Tok::Num(x) => {
                    let x = *x;
                    self.bump();
                    Expr::Const(Const::Double(-x))
                }
                _ => Expr::Neg(Box::new(self.unary()?)),
            };
            self.depth -= 1;
            return Ok(e);
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, SqlError> {
        let at = self.at();
        match self.peek().clone() {
            Tok::Int(n) => {
                self.bump();
                Ok(Expr::Const(Const::Long(n)))
            }
            Tok::Num(x) => {
                self.bump();
                Ok(Expr::Const(Const::Double(x)))
            }
            Tok::Str(s) => {
                self.bump();
                Ok(Expr::Const(Const::Str(s)))
            }
            Tok::Sym("(") => {
                self.bump();
                let e = self.or()?;
                self.expect_sym(")")?;
                Ok(e)
            }
            Tok::Word(w) if w.eq_ignore_ascii_case("TRUE") => {
                self.bump();
                Ok(Expr::Const(Const::Bool(true)))
            }
            Tok::Word(w) if w.eq_ignore_ascii_case("FALSE") => {
                self.bump();
                Ok(Expr::Const(Const::Bool(false)))
            }
            Tok::Word(w) if w.eq_ignore_ascii_case("NULL") => {
                self.bump();
                Ok(Expr::Const(Const::Null))
            }
            Tok::Word(w) if w.eq_ignore_ascii_case("EXISTS") => {
                self.bump();
                self.expect_sym("(")?;
                let p = self.property()?;
                self.expect_sym(")")?;
                Ok(Expr::Exists(p))
            }
            Tok::Word(w)
                if w.eq_ignore_ascii_case("newid")
                    && matches!(
                        self.toks.get(self.pos + 1).map(|t| &t.tok),
                        Some(Tok::Sym("("))
                    ) =>
            {
                self.bump();
                self.expect_sym("(")?;
                self.expect_sym(")")?;
                Ok(Expr::NewId)
            }
            Tok::Word(w)
                if w.eq_ignore_ascii_case("property")
                    && matches!(
                        self.toks.get(self.pos + 1).map(|t| &t.tok),
                        Some(Tok::Sym("("))
                    ) =>
            {
                self.bump();
                self.expect_sym("(")?;
                let name_at = self.at();
                let name = self.string("a property name string")?;
                self.expect_sym(")")?;
                let prop = if let Some(sys) = strip_prefix_ci(&name, "sys.") {
                    Prop::Sys(system(sys, name_at + 1)?)
                } else {
                    Prop::User(strip_prefix_ci(&name, "user.").unwrap_or(&name).to_owned())
                };
                Ok(Expr::Prop(prop))
            }
            Tok::Word(_) | Tok::Quoted(_) => Ok(Expr::Prop(self.property()?)),
            _ => Err(SqlError::new(at, self.unexpected("an expression").message)),
        }
    }

    /// `[sys. | user.] name`
    fn property(&mut self) -> Result<Prop, SqlError> {
        let at = self.at();
        let first = match self.peek().clone() {
            Tok::Word(w) if KEYWORDS.iter().any(|k| w.eq_ignore_ascii_case(k)) => {
                return Err(SqlError::new(
                    at,
                    format!("'{w}' is a keyword: write [{w}] for a property of that name"),
                ));
            }
            Tok::Word(w) => (w, false),
            Tok::Quoted(w) => (w, true),
            _ => return Err(self.unexpected("a property name")),
        };
        self.bump();
        let scope = match &first {
            (w, false) if w.eq_ignore_ascii_case("sys") => Some(true),
            (w, false) if w.eq_ignore_ascii_case("user") => Some(false),
            _ => None,
        };
        if let (Some(sys), Tok::Sym(".")) = (scope, self.peek()) {
            self.bump();
            let name_at = self.at();
            let name = match self.peek().clone() {
                Tok::Word(w) | Tok::Quoted(w) => w,
                _ => return Err(self.unexpected("a property name after the scope")),
            };
            self.bump();
            return if sys { Ok(Prop::Sys(system(&name, name_at)?)) } else { Ok(Prop::User(name)) };
        }
        Ok(Prop::User(first.0))
    }

    fn statement(&mut self) -> Result<Stmt, SqlError> {
        if self.eat_kw("SET") {
            let at = self.at();
            let p = self.property()?;
            if p == Prop::Sys(Sys::Size) {
                return Err(SqlError::new(at, "sys.Size cannot be set"));
            }
            self.expect_sym("=")?;
            let e = self.or()?;
            return Ok(Stmt::Set(p, e));
        }
        if self.eat_kw("REMOVE") {
            return Ok(Stmt::Remove(self.property()?));
        }
        Err(self.unexpected("SET or REMOVE"))
    }
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| &s[prefix.len()..])
}

fn system(name: &str, at: usize) -> Result<Sys, SqlError> {
    SYSTEM.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, s)| *s).ok_or_else(|| {
        SqlError::new(
            at,
            format!(
                "sys.{name} is not a system property filters can read (known: {})",
                SYSTEM.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        )
    })
}
