//! Evaluation with three values (true, false, unknown), borrowing from the message.

use std::cmp::Ordering;

use twice::{Message, MessageId, SessionId, Timestamp, Value};
use uuid::Uuid;

use super::parse::{Arith, Cmp, Const, Expr, Prop, Stmt, Sys};

/// A value during evaluation. Unknown and null are `None` where a value is expected.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum SqlValue<'a> {
    /// A boolean.
    Bool(bool),
    /// Any integer type.
    Long(i64),
    /// Any floating-point type, and integers too large for a `Long`.
    Double(f64),
    /// A string or symbol.
    Str(&'a str),
    /// A character.
    Char(char),
    /// A UUID (also what `newid()` returns).
    Uuid(Uuid),
    /// A point in time.
    Time(Timestamp),
    /// Bytes: they compare only for equality.
    Binary(&'a [u8]),
}

pub(super) fn truth(e: &Expr, m: &Message) -> Option<bool> {
    match value(e, m)? {
        SqlValue::Bool(b) => Some(b),
        _ => None,
    }
}

pub(super) fn value<'a>(e: &'a Expr, m: &'a Message) -> Option<SqlValue<'a>> {
    match e {
        Expr::Const(c) => constant(c),
        Expr::Prop(p) => property(p, m),
        Expr::NewId => Some(SqlValue::Uuid(Uuid::new_v4())),
        Expr::Neg(e) => match value(e, m)? {
            SqlValue::Long(n) => n.checked_neg().map(SqlValue::Long),
            SqlValue::Double(x) => Some(SqlValue::Double(-x)),
            _ => None,
        },
        Expr::Arith(op, a, b) => arith(*op, value(a, m)?, value(b, m)?),
        Expr::Cmp(op, a, b) => {
            let ord = compare(value(a, m)?, value(b, m)?, *op)?;
            Some(SqlValue::Bool(match op {
                Cmp::Eq => ord == Ordering::Equal,
                Cmp::Ne => ord != Ordering::Equal,
                Cmp::Lt => ord == Ordering::Less,
                Cmp::Le => ord != Ordering::Greater,
                Cmp::Gt => ord == Ordering::Greater,
                Cmp::Ge => ord != Ordering::Less,
            }))
        }
        Expr::And(a, b) => match (truth(a, m), truth(b, m)) {
            (Some(false), _) | (_, Some(false)) => Some(SqlValue::Bool(false)),
            (Some(true), Some(true)) => Some(SqlValue::Bool(true)),
            _ => None,
        },
        Expr::Or(a, b) => match (truth(a, m), truth(b, m)) {
            (Some(true), _) | (_, Some(true)) => Some(SqlValue::Bool(true)),
            (Some(false), Some(false)) => Some(SqlValue::Bool(false)),
            _ => None,
        },
        Expr::Not(e) => truth(e, m).map(|b| SqlValue::Bool(!b)),
        Expr::In { expr, list, negated } => {
            let v = value(expr, m)?;
            let mut unknown = false;
            for item in list {
                match value(item, m).and_then(|w| compare(v, w, Cmp::Eq)) {
                    Some(Ordering::Equal) => return Some(SqlValue::Bool(!negated)),
                    Some(_) => {}
                    None => unknown = true,
                }
            }
            if unknown { None } else { Some(SqlValue::Bool(*negated)) }
        }
        Expr::Like { expr, pattern, negated } => {
            let mut buf = [0u8; 4];
            let s = match value(expr, m)? {
                SqlValue::Str(s) => s,
                SqlValue::Char(c) => c.encode_utf8(&mut buf),
                _ => return None,
            };
            Some(SqlValue::Bool(pattern.matches(s) != *negated))
        }
        Expr::IsNull { expr, negated } => {
            Some(SqlValue::Bool(value(expr, m).is_none() != *negated))
        }
        Expr::Exists(p) => Some(SqlValue::Bool(match p {
            Prop::Sys(s) => system(*s, m).is_some(),
            Prop::User(name) => m.application_properties.contains_key(name),
        })),
    }
}

fn constant(c: &Const) -> Option<SqlValue<'_>> {
    match c {
        Const::Null => None,
        Const::Bool(b) => Some(SqlValue::Bool(*b)),
        Const::Long(n) => Some(SqlValue::Long(*n)),
        Const::Double(x) => Some(SqlValue::Double(*x)),
        Const::Str(s) => Some(SqlValue::Str(s)),
    }
}

fn property<'a>(p: &'a Prop, m: &'a Message) -> Option<SqlValue<'a>> {
    match p {
        Prop::Sys(s) => system(*s, m),
        Prop::User(name) => m.application_properties.get(name).and_then(of_value),
    }
}

fn system(s: Sys, m: &Message) -> Option<SqlValue<'_>> {
    fn text(o: Option<&str>) -> Option<SqlValue<'_>> {
        o.map(SqlValue::Str)
    }
    match s {
        Sys::MessageId => text(m.message_id.as_ref().map(MessageId::as_str)),
        Sys::CorrelationId => text(m.correlation_id.as_deref()),
        Sys::SessionId => text(m.session_id.as_ref().map(SessionId::as_str)),
        Sys::ReplyToSessionId => text(m.reply_to_session_id.as_deref()),
        Sys::Label => text(m.subject.as_deref()),
        Sys::To => text(m.to.as_deref()),
        Sys::ReplyTo => text(m.reply_to.as_deref()),
        Sys::ContentType => text(m.content_type.as_deref()),
        Sys::PartitionKey => text(m.partition_key.as_deref()),
        Sys::ScheduledEnqueueTimeUtc => m.scheduled_enqueue_time.map(SqlValue::Time),
        Sys::Size => i64::try_from(m.body.len()).ok().map(SqlValue::Long),
    }
}

/// The evaluation value of an application property (`None` for null).
fn of_value(v: &Value) -> Option<SqlValue<'_>> {
    Some(match v {
        Value::Bool(b) => SqlValue::Bool(*b),
        Value::Ubyte(n) => SqlValue::Long(i64::from(*n)),
        Value::Ushort(n) => SqlValue::Long(i64::from(*n)),
        Value::Uint(n) => SqlValue::Long(i64::from(*n)),
        #[allow(clippy::cast_precision_loss)] // reason: beyond i64 only a float can hold it
        Value::Ulong(n) => i64::try_from(*n).map_or(SqlValue::Double(*n as f64), SqlValue::Long),
        Value::Byte(n) => SqlValue::Long(i64::from(*n)),
        Value::Short(n) => SqlValue::Long(i64::from(*n)),
        Value::Int(n) => SqlValue::Long(i64::from(*n)),
        Value::Long(n) => SqlValue::Long(*n),
        Value::Float(x) => SqlValue::Double(f64::from(*x)),
        Value::Double(x) => SqlValue::Double(*x),
        Value::Char(c) => SqlValue::Char(*c),
        Value::Timestamp(t) => SqlValue::Time(*t),
        Value::Uuid(u) => SqlValue::Uuid(*u),
        Value::Binary(b) => SqlValue::Binary(b),
        Value::String(s) | Value::Symbol(s) => SqlValue::Str(s),
        _ => return None,
    })
}

#[allow(clippy::cast_precision_loss)] // reason: SQL mixes integers and floats as doubles
fn as_f64(v: SqlValue<'_>) -> Option<f64> {
    match v {
        SqlValue::Long(n) => Some(n as f64),
        SqlValue::Double(x) => Some(x),
        _ => None,
    }
}

fn arith<'a>(op: Arith, a: SqlValue<'a>, b: SqlValue<'a>) -> Option<SqlValue<'a>> {
    if let (SqlValue::Long(a), SqlValue::Long(b)) = (a, b) {
        return match op {
            Arith::Add => a.checked_add(b),
            Arith::Sub => a.checked_sub(b),
            Arith::Mul => a.checked_mul(b),
            Arith::Div => a.checked_div(b),
            Arith::Rem => a.checked_rem(b),
        }
        .map(SqlValue::Long);
    }
    let (a, b) = (as_f64(a)?, as_f64(b)?);
    let x = match op {
        Arith::Add => a + b,
        Arith::Sub => a - b,
        Arith::Mul => a * b,
        Arith::Div if b == 0.0 => return None,
        Arith::Div => a / b,
        Arith::Rem if b == 0.0 => return None,
        Arith::Rem => a % b,
    };
    x.is_finite().then_some(SqlValue::Double(x))
}

/// How `a` orders against `b`, or `None` when they cannot be compared with `op` (values of
/// different kinds; an order between booleans, UUIDs or bytes).
fn compare(a: SqlValue<'_>, b: SqlValue<'_>, op: Cmp) -> Option<Ordering> {
    let equality_only = matches!(op, Cmp::Eq | Cmp::Ne);
    let mut ba = [0u8; 4];
    let mut bb = [0u8; 4];
    match (a, b) {
        (SqlValue::Long(a), SqlValue::Long(b)) => Some(a.cmp(&b)),
        (SqlValue::Long(_) | SqlValue::Double(_), SqlValue::Long(_) | SqlValue::Double(_)) => {
            as_f64(a)?.partial_cmp(&as_f64(b)?)
        }
        (SqlValue::Str(_) | SqlValue::Char(_), SqlValue::Str(_) | SqlValue::Char(_)) => {
            let (a, b) = (text_of(a, &mut ba)?, text_of(b, &mut bb)?);
            Some(a.cmp(b))
        }
        (SqlValue::Time(a), SqlValue::Time(b)) => Some(a.cmp(&b)),
        (SqlValue::Bool(a), SqlValue::Bool(b)) if equality_only => Some(a.cmp(&b)),
        (SqlValue::Uuid(a), SqlValue::Uuid(b)) if equality_only => Some(a.cmp(&b)),
        (SqlValue::Binary(a), SqlValue::Binary(b)) if equality_only => Some(a.cmp(b)),
        _ => None,
    }
}

/// The text of a string or a character (written into `buf`).
fn text_of<'a>(v: SqlValue<'a>, buf: &'a mut [u8; 4]) -> Option<&'a str> {
    match v {
        SqlValue::Str(s) => Some(s),
        SqlValue::Char(c) => Some(c.encode_utf8(buf)),
        _ => None,
    }
}

/// The owned application-property value of an evaluation result.
fn to_value(v: Option<SqlValue<'_>>) -> Value {
    match v {
        None => Value::Null,
        Some(SqlValue::Bool(b)) => Value::Bool(b),
        Some(SqlValue::Long(n)) => Value::Long(n),
        Some(SqlValue::Double(x)) => Value::Double(x),
        Some(SqlValue::Str(s)) => Value::String(s.to_owned()),
        Some(SqlValue::Char(c)) => Value::Char(c),
        Some(SqlValue::Uuid(u)) => Value::Uuid(u),
        Some(SqlValue::Time(t)) => Value::Timestamp(t),
        Some(SqlValue::Binary(b)) => Value::Binary(bytes::Bytes::copy_from_slice(b)),
    }
}

/// The text a system property is set to.
fn to_text(v: Option<SqlValue<'_>>) -> Option<String> {
    Some(match v? {
        SqlValue::Bool(b) => b.to_string(),
        SqlValue::Long(n) => n.to_string(),
        SqlValue::Double(x) => x.to_string(),
        SqlValue::Str(s) => s.to_owned(),
        SqlValue::Char(c) => c.to_string(),
        SqlValue::Uuid(u) => u.to_string(),
        SqlValue::Time(t) => t.to_string(),
        SqlValue::Binary(_) => return None,
    })
}

pub(super) fn apply(stmt: &Stmt, m: &mut Message) {
    match stmt {
        Stmt::Set(Prop::User(name), e) => {
            let v = to_value(value(e, m));
            m.application_properties.insert(name.clone(), v);
        }
        Stmt::Set(Prop::Sys(Sys::ScheduledEnqueueTimeUtc), e) => {
            m.scheduled_enqueue_time = match value(e, m) {
                Some(SqlValue::Time(t)) => Some(t),
                _ => None,
            };
        }
        Stmt::Set(Prop::Sys(s), e) => {
            let text = to_text(value(e, m));
            set_system(*s, text, m);
        }
        Stmt::Remove(Prop::User(name)) => {
            m.application_properties.remove(name);
        }
        Stmt::Remove(Prop::Sys(s)) => set_system(*s, None, m),
    }
}

fn set_system(s: Sys, text: Option<String>, m: &mut Message) {
    match s {
        Sys::MessageId => m.message_id = text.map(MessageId::new),
        Sys::CorrelationId => m.correlation_id = text,
        Sys::SessionId => m.session_id = text.map(SessionId::new),
        Sys::ReplyToSessionId => m.reply_to_session_id = text,
        Sys::Label => m.subject = text,
        Sys::To => m.to = text,
        Sys::ReplyTo => m.reply_to = text,
        Sys::ContentType => m.content_type = text,
        Sys::PartitionKey => m.partition_key = text,
        Sys::ScheduledEnqueueTimeUtc => m.scheduled_enqueue_time = None,
        // Refused by the parser: the size is the body's.
        Sys::Size => {}
    }
}

/// How to read one text system property of a message.
pub(super) type ReadText = fn(&Message) -> Option<&str>;

/// The text system properties an action can set, with how to read each.
pub(super) const SYSTEM_TEXT: [(&str, ReadText); 9] = [
    ("MessageId", |m| m.message_id.as_ref().map(MessageId::as_str)),
    ("CorrelationId", |m| m.correlation_id.as_deref()),
    ("SessionId", |m| m.session_id.as_ref().map(SessionId::as_str)),
    ("ReplyToSessionId", |m| m.reply_to_session_id.as_deref()),
    ("Label", |m| m.subject.as_deref()),
    ("To", |m| m.to.as_deref()),
    ("ReplyTo", |m| m.reply_to.as_deref()),
    ("ContentType", |m| m.content_type.as_deref()),
    ("PartitionKey", |m| m.partition_key.as_deref()),
];

/// Sets a text system property by its name in [`SYSTEM_TEXT`] (other names change nothing).
pub(super) fn set_system_by_name(name: &str, text: Option<String>, m: &mut Message) {
    let field = match name {
        "MessageId" => Sys::MessageId,
        "CorrelationId" => Sys::CorrelationId,
        "SessionId" => Sys::SessionId,
        "ReplyToSessionId" => Sys::ReplyToSessionId,
        "Label" => Sys::Label,
        "To" => Sys::To,
        "ReplyTo" => Sys::ReplyTo,
        "ContentType" => Sys::ContentType,
        "PartitionKey" => Sys::PartitionKey,
        _ => return,
    };
    set_system(field, text, m);
}
