//! The operations on a subscription's rules, and rules as `add-rule` describes them and
//! `enumerate-rules` lists them.

use twice_amqp::servicebus::ManagementReply;
use twice_broker::config::{CorrelationFilter, Filter};
use twice_broker::sql::{SqlAction, SqlFilter};

use super::{Ctx, Status, bad, bounded};
use crate::backend::{Backend, BackendError, Rule};
use crate::codec::Value;
use crate::mapping;
use crate::performative::described_list;

/// `add-rule`.
pub(super) async fn add<B: Backend>(
    ctx: &Ctx<'_, B>,
    name: String,
    description: &Value,
) -> Result<Status, Status> {
    let rule = rule_of(name, description)?;
    ctx.backend.add_rule(ctx.entity, rule).await.map_err(|e| Status::backend(&e))?;
    Ok(Status::ok(ManagementReply::Empty))
}

/// `remove-rule`.
pub(super) async fn remove<B: Backend>(ctx: &Ctx<'_, B>, name: &str) -> Result<Status, Status> {
    ctx.backend.remove_rule(ctx.entity, name).await.map_err(|e| Status::backend(&e))?;
    Ok(Status::ok(ManagementReply::Empty))
}

/// `enumerate-rules`: up to `top` rules after `skip`.
pub(super) async fn enumerate<B: Backend>(
    ctx: &Ctx<'_, B>,
    skip: i64,
    top: i64,
) -> Result<Status, Status> {
    let rules = ctx.backend.rules(ctx.entity).await.map_err(|e| Status::backend(&e))?;
    let (skip, top) = (bounded(skip, 0, i64::MAX), bounded(top, 0, i64::MAX));
    let items: Vec<Value> = rules.iter().skip(skip).take(top).map(rule_value).collect();
    if items.is_empty() {
        return Ok(Status::no_content());
    }
    Ok(Status::ok(ManagementReply::Rules(items)))
}

fn text(body: &Value, key: &str) -> Option<String> {
    body.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// Descriptor codes of the rule types (`com.microsoft:*:list`), as the SDKs match them.
const SQL_FILTER: u64 = 0x0000_0013_7000_0006;
const TRUE_FILTER: u64 = 0x0000_0013_7000_0007;
const FALSE_FILTER: u64 = 0x0000_0013_7000_0008;
const CORRELATION_FILTER: u64 = 0x0000_0013_7000_0009;
const RULE_DESCRIPTION: u64 = 0x0000_0137_0000_0004;
const EMPTY_ACTION: u64 = 0x0000_0137_0000_0005;
const SQL_ACTION: u64 = 0x0000_0137_0000_0006;

/// A rule from an `add-rule` description map (`sql-filter` / `correlation-filter` /
/// `sql-rule-action`); a SQL expression that does not parse is a bad request.
fn rule_of(name: String, desc: &Value) -> Result<Rule, Status> {
    let invalid = |e: &dyn std::fmt::Display, s: &str| {
        Status::backend(&BackendError::Invalid(format!("{e} in {s:?}")))
    };
    let action = desc.get("sql-rule-action").and_then(|a| text(a, "expression"));
    let filter = if let Some(sql) = desc.get("sql-filter") {
        let expr = text(sql, "expression").ok_or_else(|| bad("sql-filter needs an expression"))?;
        match expr.trim().to_ascii_uppercase().as_str() {
            "1=1" | "TRUE" => Filter::True,
            "1=0" | "FALSE" => Filter::False,
            _ => Filter::Sql(SqlFilter::parse(&expr).map_err(|e| invalid(&e, &expr))?),
        }
    } else if let Some(c) = desc.get("correlation-filter") {
        let mut f = CorrelationFilter::default();
        f.correlation_id = text(c, "correlation-id");
        f.message_id = text(c, "message-id");
        f.to = text(c, "to");
        f.reply_to = text(c, "reply-to");
        f.subject = text(c, "label").or_else(|| text(c, "subject"));
        f.session_id = text(c, "session-id");
        f.reply_to_session_id = text(c, "reply-to-session-id");
        f.content_type = text(c, "content-type");
        f.properties = mapping::properties_of(c.get("properties"), &[]);
        Filter::Correlation(f)
    } else {
        Filter::True
    };
    let mut rule = Rule::new(name, filter);
    if let Some(a) = action {
        rule = rule.with_action(SqlAction::parse(&a).map_err(|e| invalid(&e, &a))?);
    }
    Ok(rule)
}

/// A rule as the `enumerate-rules` reply describes it.
fn rule_value(rule: &Rule) -> Value {
    let s = |o: &Option<String>| o.clone().map_or(Value::Null, Value::String);
    let filter = match &rule.filter {
        Filter::Sql(f) => {
            described_list(SQL_FILTER, vec![Value::String(f.expression().to_owned())])
        }
        Filter::True => described_list(TRUE_FILTER, vec![Value::string("1=1")]),
        Filter::Correlation(c) => described_list(
            CORRELATION_FILTER,
            vec![
                s(&c.correlation_id),
                s(&c.message_id),
                s(&c.to),
                s(&c.reply_to),
                s(&c.subject),
                s(&c.session_id),
                s(&c.reply_to_session_id),
                s(&c.content_type),
                Value::Map(
                    c.properties
                        .iter()
                        .map(|(k, v)| (Value::String(k.clone()), mapping::from_twice_value(v)))
                        .collect(),
                ),
            ],
        ),
        // `False`, and any filter this reply has no descriptor for, selects nothing.
        _ => described_list(FALSE_FILTER, vec![Value::string("1=0")]),
    };
    let action = match &rule.action {
        Some(a) => described_list(SQL_ACTION, vec![Value::String(a.expression().to_owned())]),
        None => described_list(EMPTY_ACTION, vec![]),
    };
    Value::Map(vec![(
        Value::string("rule-description"),
        described_list(RULE_DESCRIPTION, vec![filter, action, Value::String(rule.name.clone())]),
    )])
}
