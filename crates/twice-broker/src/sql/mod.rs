//! Service Bus SQL filters and rule actions: the subset of SQL-92 that a subscription rule's
//! `SqlFilter` and `SqlRuleAction` are written in.
//!
//! ```
//! use twice::Message;
//! use twice_broker::sql::{SqlAction, SqlFilter};
//!
//! let filter = SqlFilter::parse("color = 'red' AND (quantity > 10 OR sys.Label LIKE 'rush%')")?;
//! let mut message = Message::new("…").with_subject("rush-order");
//! message.application_properties.insert("color".into(), "red".into());
//! assert!(filter.matches(&message));
//!
//! let action = SqlAction::parse("SET priority = 'high'; REMOVE color")?;
//! action.apply(&mut message);
//! assert_eq!(message.application_properties["priority"].as_str(), Some("high"));
//! assert!(!message.application_properties.contains_key("color"));
//! # Ok::<(), twice_broker::sql::SqlError>(())
//! ```
//!
//! # The language
//!
//! - Predicates: `=`, `<>`, `!=`, `<`, `<=`, `>`, `>=`; `AND`, `OR`, `NOT`;
//!   `expr [NOT] IN (expr, …)`; `expr [NOT] LIKE pattern [ESCAPE 'c']` (`%` any run, `_` any one
//!   character); `property IS [NOT] NULL`; `EXISTS(property)`; parentheses.
//! - Expressions: constants (integers, decimals and `1.5E3` numbers, `'strings'` with `''` for a
//!   quote, `TRUE`, `FALSE`, `NULL`), properties, `+ - * / %`, unary `+`/`-`, `newid()`,
//!   `property('name')`.
//! - Properties: `sys.Name` is a system property of the message (`MessageId`, `CorrelationId`,
//!   `SessionId`, `ReplyToSessionId`, `Label`, `To`, `ReplyTo`, `ContentType`, `PartitionKey`,
//!   `ScheduledEnqueueTimeUtc`, `Size`; names are matched ignoring case); `user.name` or a bare
//!   `name` is an application property. Names that are not plain identifiers are written
//!   `[like this]` or `"like this"`.
//! - Keywords are case-insensitive; string comparison is ordinal and case-sensitive.
//!
//! # Evaluation
//!
//! Evaluation has three values, as in SQL: a missing application property, `NULL`, and any
//! operation on them are *unknown*; `NOT unknown` is unknown; `FALSE AND unknown` is false and
//! `TRUE OR unknown` is true. A filter selects a message only when it evaluates to true. Numbers
//! compare by value across integer and floating-point types (an integer operation that
//! overflows, and a division by zero, are unknown); there is no implicit conversion between
//! strings and numbers, so comparing values of different kinds is unknown. `IS NULL` is true for
//! a missing property or one whose value is null; `EXISTS` is true when the property is present,
//! even with a null value. A system property the message does not have (say `sys.To` on a
//! message without `To`) is null. Naming a system property twice does not know is an error when
//! the expression is parsed, not when a message arrives.
//!
//! Matching does not allocate: values borrow from the message.
//!
//! # Actions
//!
//! An action is one or more statements separated by `;`: `SET property = expression` and
//! `REMOVE property`. They run in order on the copy of the message that the rule's subscription
//! receives; each expression sees the changes made before it. `SET` on a system property sets
//! its text (`SET sys.Label = 'x'`); `REMOVE` on one clears it.

mod eval;
mod lex;
mod like;
mod parse;

#[cfg(test)]
mod tests;

use std::fmt;

use twice::Message;

pub use eval::SqlValue;
use parse::{Expr, Stmt};

/// An expression that could not be parsed: what is wrong and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message} at position {position}")]
#[non_exhaustive]
pub struct SqlError {
    /// The byte offset in the expression where the problem was found.
    pub position: usize,
    /// What is wrong.
    pub message: String,
}

impl SqlError {
    fn new(position: usize, message: impl Into<String>) -> Self {
        Self { position, message: message.into() }
    }
}

/// The longest filter or action expression accepted, in bytes (Service Bus allows 1,024
/// characters).
pub const MAX_EXPRESSION_LEN: usize = 4096;

/// A parsed SQL filter.
#[derive(Clone, PartialEq)]
pub struct SqlFilter {
    text: String,
    expr: Expr,
}

impl SqlFilter {
    /// Parses a filter expression.
    ///
    /// # Errors
    ///
    /// [`SqlError`] with the position of the first problem.
    pub fn parse(text: &str) -> Result<Self, SqlError> {
        let expr = parse::predicate(text)?;
        Ok(Self { text: text.to_owned(), expr })
    }

    /// The expression as it was written.
    pub fn expression(&self) -> &str {
        &self.text
    }

    /// Whether the filter selects the message (it evaluates to true, not false or unknown).
    pub fn matches(&self, message: &Message) -> bool {
        eval::truth(&self.expr, message) == Some(true)
    }

    /// The value the expression has for a message (`None`: unknown).
    pub fn evaluate<'a>(&'a self, message: &'a Message) -> Option<SqlValue<'a>> {
        eval::value(&self.expr, message)
    }
}

impl fmt::Debug for SqlFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SqlFilter").field(&self.text).finish()
    }
}

/// A parsed SQL rule action: `SET` and `REMOVE` statements.
#[derive(Clone, PartialEq)]
pub struct SqlAction {
    text: String,
    statements: Vec<Stmt>,
}

impl SqlAction {
    /// Parses an action.
    ///
    /// # Errors
    ///
    /// [`SqlError`] with the position of the first problem.
    pub fn parse(text: &str) -> Result<Self, SqlError> {
        let statements = parse::action(text)?;
        Ok(Self { text: text.to_owned(), statements })
    }

    /// The action as it was written.
    pub fn expression(&self) -> &str {
        &self.text
    }

    /// Applies the statements, in order, to a message.
    pub fn apply(&self, message: &mut Message) {
        for statement in &self.statements {
            eval::apply(statement, message);
        }
    }
}

// Both are stored (in the log, with their rule) as the text they were written in, and parsed
// again when read back.
macro_rules! serde_as_text {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.text)
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                Self::parse(&text).map_err(serde::de::Error::custom)
            }
        }
    };
}

serde_as_text!(SqlFilter);
serde_as_text!(SqlAction);

impl fmt::Debug for SqlAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SqlAction").field(&self.text).finish()
    }
}

/// What a rule action changed in a subscription's copy of a message, kept with the copy (the
/// copy shares its body with the topic's message, so the broker stores the difference, not a
/// second message). Applied in [`Changes::replay`] when the copy is delivered.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Changes {
    /// Application properties the action removed.
    pub(crate) removed: Vec<String>,
    /// System properties it set or cleared, by name (`Label`, `To`, …).
    pub(crate) system: Vec<(String, Option<String>)>,
}

impl Changes {
    /// The difference between a message and the copy an action made of it; the application
    /// properties that were set or changed are returned apart, as the broker merges them like
    /// the properties an abandon sets.
    pub(crate) fn between(before: &Message, after: &Message) -> (twice::Properties, Changes) {
        let set = after
            .application_properties
            .iter()
            .filter(|(k, v)| before.application_properties.get(*k) != Some(v))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let removed = before
            .application_properties
            .keys()
            .filter(|k| !after.application_properties.contains_key(*k))
            .cloned()
            .collect();
        let system = eval::SYSTEM_TEXT
            .iter()
            .filter_map(|(name, get)| {
                let (b, a) = (get(before), get(after));
                (b != a).then(|| ((*name).to_owned(), a.map(str::to_owned)))
            })
            .collect();
        (set, Changes { removed, system })
    }

    /// Whether nothing beyond properties changed.
    pub(crate) fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.system.is_empty()
    }

    /// Makes the same changes to the stored message.
    pub(crate) fn replay(&self, message: &mut Message) {
        for name in &self.removed {
            message.application_properties.remove(name);
        }
        for (name, value) in &self.system {
            eval::set_system_by_name(name, value.clone(), message);
        }
    }
}
