//! The ATOM bodies of the administration API: requests parsed into the broker's entity model,
//! and entries and feeds written in the element order Service Bus uses.
//!
//! Requests are read namespace-blind (by local name), as the SDKs write the same document with
//! different prefixes; responses carry the namespaces and prefixes the service sends.

use std::fmt::Write as _;
use std::time::Duration;

use quick_xml::escape::escape;
use quick_xml::events::Event;
use twice::{Properties, Timestamp, Value};
use twice_broker::MessageCounts;
use twice_broker::config::{
    CorrelationFilter, Filter, QueueProperties, Rule, SubscriptionProperties, TopicProperties,
    format_duration, parse_duration,
};
use twice_broker::sql::{SqlAction, SqlFilter};

/// The Service Bus schema namespace of descriptions.
pub(crate) const SB_NS: &str =
    "http://schemas.microsoft.com/netservices/2010/10/servicebus/connect";
/// The namespace of `CountDetails`' children.
const COUNTS_NS: &str = "http://schemas.microsoft.com/netservices/2011/06/servicebus";
/// `XmlSchema-instance`, for `i:type`.
const XSI_NS: &str = "http://www.w3.org/2001/XMLSchema-instance";
/// .NET's `TimeSpan.MaxValue`, what Service Bus writes for "never".
pub(crate) const FOREVER: &str = "P10675199DT2H48M5.4775807S";
/// Durations at least this long are "never" (`TimeSpan.MaxValue` is 10675199 days).
const FOREVER_DAYS: u64 = 10_675_199;
/// How deep a request document may nest.
const MAX_DEPTH: usize = 32;
/// The most attributes one element may carry. An entity description carries a handful; the
/// XML reader checks each attribute against the ones before it, so the cap also bounds that.
const MAX_ATTRIBUTES: usize = 64;
/// The most elements a request document may hold (a rule with many correlation properties
/// holds a few hundred).
const MAX_ELEMENTS: usize = 4096;

/// Why a request body was refused (a 400 with this text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadRequest(pub(crate) String);

fn bad<T>(msg: impl Into<String>) -> Result<T, BadRequest> {
    Err(BadRequest(msg.into()))
}

/// An element of a request: its local name, attributes by local name, text and children.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Element {
    pub(crate) name: String,
    pub(crate) attrs: Vec<(String, String)>,
    pub(crate) text: String,
    pub(crate) children: Vec<Element>,
}

impl Element {
    /// The first child of this local name.
    pub(crate) fn child(&self, name: &str) -> Option<&Element> {
        self.children.iter().find(|c| c.name == name)
    }

    /// An attribute by local name.
    fn attr(&self, name: &str) -> Option<&str> {
        self.attrs.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// `i:type` without its prefix.
    fn xsi_type(&self) -> Option<&str> {
        self.attr("type").map(|t| t.rsplit(':').next().unwrap_or(t))
    }
}

fn local(name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    name.rsplit(':').next().unwrap_or_default().to_owned()
}

/// Parses a document into its root element.
pub(crate) fn parse(body: &[u8]) -> Result<Element, BadRequest> {
    let text = std::str::from_utf8(body).map_err(|_| BadRequest("the body is not UTF-8".into()))?;
    let mut reader = quick_xml::Reader::from_str(text);
    let mut stack: Vec<Element> = Vec::new();
    let mut root = None;
    let mut elements = 0usize;
    loop {
        let event = reader
            .read_event()
            .map_err(|e| BadRequest(format!("the body is not well-formed XML: {e}")))?;
        match event {
            Event::Start(start) | Event::Empty(start) if root.is_some() => {
                let _ = start;
                return bad("the body has more than one root element");
            }
            Event::Start(start) => {
                if stack.len() >= MAX_DEPTH {
                    return bad(format!("the body nests deeper than {MAX_DEPTH} elements"));
                }
                count_element(&mut elements)?;
                stack.push(element(&start)?);
            }
            Event::Empty(start) => {
                count_element(&mut elements)?;
                let e = element(&start)?;
                match stack.last_mut() {
                    Some(parent) => parent.children.push(e),
                    None => root = Some(e),
                }
            }
            Event::End(_) => {
                let Some(done) = stack.pop() else {
                    return bad("the body is not well-formed XML: unexpected end tag");
                };
                match stack.last_mut() {
                    Some(parent) => parent.children.push(done),
                    None => root = Some(done),
                }
            }
            Event::Text(t) => {
                if let Some(top) = stack.last_mut() {
                    let t = t
                        .unescape()
                        .map_err(|e| BadRequest(format!("the body is not well-formed XML: {e}")))?;
                    top.text.push_str(&t);
                }
            }
            Event::CData(t) => {
                if let Some(top) = stack.last_mut() {
                    top.text.push_str(&String::from_utf8_lossy(&t));
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if !stack.is_empty() {
        return bad("the body is not well-formed XML: it ends inside an element");
    }
    root.ok_or_else(|| BadRequest("the body has no XML element".into()))
}

/// Counts one more element of the document, refusing it past [`MAX_ELEMENTS`].
fn count_element(elements: &mut usize) -> Result<(), BadRequest> {
    *elements += 1;
    if *elements > MAX_ELEMENTS {
        return bad(format!("the body has more than {MAX_ELEMENTS} elements"));
    }
    Ok(())
}

fn element(start: &quick_xml::events::BytesStart<'_>) -> Result<Element, BadRequest> {
    let mut e = Element { name: local(start.name().as_ref()), ..Element::default() };
    for (i, a) in start.attributes().enumerate() {
        if i == MAX_ATTRIBUTES {
            return bad(format!(
                "<{}> has more than {MAX_ATTRIBUTES} attributes",
                e.name.chars().take(64).collect::<String>()
            ));
        }
        let a = a.map_err(|e| BadRequest(format!("the body is not well-formed XML: {e}")))?;
        let v = a
            .unescape_value()
            .map_err(|e| BadRequest(format!("the body is not well-formed XML: {e}")))?;
        e.attrs.push((local(a.key.as_ref()), v.into_owned()));
    }
    Ok(e)
}

/// What a PUT body describes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Description {
    /// `QueueDescription`.
    Queue(Element),
    /// `TopicDescription`.
    Topic(Element),
    /// `SubscriptionDescription`.
    Subscription(Element),
    /// `RuleDescription`.
    Rule(Element),
}

/// The description inside `<entry><content>`.
pub(crate) fn description(body: &[u8]) -> Result<Description, BadRequest> {
    let root = parse(body)?;
    if root.name != "entry" {
        return bad(format!("the body is a <{}>, not an ATOM <entry>", root.name));
    }
    let Some(content) = root.child("content") else {
        return bad("the <entry> has no <content>");
    };
    let Some(d) = content.children.first() else {
        return bad("the <content> holds no description");
    };
    Ok(match d.name.as_str() {
        "QueueDescription" => Description::Queue(d.clone()),
        "TopicDescription" => Description::Topic(d.clone()),
        "SubscriptionDescription" => Description::Subscription(d.clone()),
        "RuleDescription" => Description::Rule(d.clone()),
        other => return bad(format!("<{other}> is not a queue, topic, subscription or rule")),
    })
}

fn duration(e: &Element) -> Result<Duration, BadRequest> {
    parse_duration(e.text.trim()).map_err(|m| BadRequest(format!("{}: {m}", e.name)))
}

/// A duration where `TimeSpan.MaxValue` (or anything as long) means none.
fn optional_duration(e: &Element) -> Result<Option<Duration>, BadRequest> {
    let d = duration(e)?;
    Ok((d.as_secs() / 86_400 < FOREVER_DAYS).then_some(d))
}

fn boolean(e: &Element) -> Result<bool, BadRequest> {
    match e.text.trim() {
        "true" | "True" | "1" => Ok(true),
        "false" | "False" | "0" => Ok(false),
        other => bad(format!("{}: {other:?} is not true or false", e.name)),
    }
}

fn number<T: std::str::FromStr>(e: &Element) -> Result<T, BadRequest> {
    e.text
        .trim()
        .parse()
        .map_err(|_| BadRequest(format!("{}: {:?} is not a number", e.name, e.text)))
}

/// The entity a `ForwardTo` names: the path of an absolute address, or the name as given.
fn forward_target(e: &Element) -> Option<String> {
    let t = e.text.trim();
    if t.is_empty() {
        return None;
    }
    let path = match t.split_once("://") {
        Some((_, rest)) => rest.split_once('/').map_or("", |(_, p)| p),
        None => t,
    };
    Some(path.trim_matches('/').to_owned())
}

/// Properties the broker does not have: accepted only with the value that means "off".
fn unsupported(e: &Element) -> Result<bool, BadRequest> {
    let ok = match e.name.as_str() {
        "AutoDeleteOnIdle" => optional_duration(e)?.is_none(),
        "EnablePartitioning" | "EnableExpress" | "EnableSubscriptionPartitioning" => !boolean(e)?,
        "Status" => matches!(e.text.trim(), "" | "Active"),
        "UserMetadata" => e.text.trim().is_empty(),
        "AuthorizationRules" => e.children.is_empty(),
        "DeadLetteringOnFilterEvaluationExceptions" => true,
        // Read-only, advisory or premium-only values the SDKs echo back on update.
        "EnableBatchedOperations"
        | "SizeInBytes"
        | "MessageCount"
        | "IsAnonymousAccessible"
        | "CreatedAt"
        | "UpdatedAt"
        | "AccessedAt"
        | "SupportOrdering"
        | "CountDetails"
        | "EntityAvailabilityStatus"
        | "MaxMessageSizeInKilobytes"
        | "FilteringMessagesBeforePublishing"
        | "SubscriptionCount"
        | "SqlFilterCount"
        | "CorrelationFilterCount"
        | "DefaultRuleDescription" => true,
        // Elements of later service versions: ignored, as the service ignores what it does
        // not know of older clients.
        _ => return Ok(false),
    };
    if !ok {
        return bad(format!("{} = {:?} is not supported", e.name, e.text.trim()));
    }
    Ok(true)
}

/// Applies a `QueueDescription` to `p` (the defaults on create, the current ones on update).
pub(crate) fn apply_queue(d: &Element, p: &mut QueueProperties) -> Result<(), BadRequest> {
    for e in &d.children {
        match e.name.as_str() {
            "LockDuration" => p.lock_duration = duration(e)?,
            "MaxSizeInMegabytes" => p.max_size_in_megabytes = number(e)?,
            "RequiresDuplicateDetection" => p.requires_duplicate_detection = boolean(e)?,
            "RequiresSession" => p.requires_session = boolean(e)?,
            "DefaultMessageTimeToLive" => p.default_message_time_to_live = optional_duration(e)?,
            "DeadLetteringOnMessageExpiration" => {
                p.dead_lettering_on_message_expiration = boolean(e)?;
            }
            "DuplicateDetectionHistoryTimeWindow" => {
                p.duplicate_detection_history_time_window = duration(e)?;
            }
            "MaxDeliveryCount" => p.max_delivery_count = number(e)?,
            "ForwardTo" => p.forward_to = forward_target(e),
            "ForwardDeadLetteredMessagesTo" => {
                p.forward_dead_lettered_messages_to = forward_target(e);
            }
            _ => {
                unsupported(e)?;
            }
        }
    }
    Ok(())
}

/// Applies a `TopicDescription` to `p`.
pub(crate) fn apply_topic(d: &Element, p: &mut TopicProperties) -> Result<(), BadRequest> {
    for e in &d.children {
        match e.name.as_str() {
            "DefaultMessageTimeToLive" => p.default_message_time_to_live = optional_duration(e)?,
            "MaxSizeInMegabytes" => p.max_size_in_megabytes = number(e)?,
            "RequiresDuplicateDetection" => p.requires_duplicate_detection = boolean(e)?,
            "DuplicateDetectionHistoryTimeWindow" => {
                p.duplicate_detection_history_time_window = duration(e)?;
            }
            _ => {
                unsupported(e)?;
            }
        }
    }
    Ok(())
}

/// Applies a `SubscriptionDescription` to `p`; returns its `DefaultRuleDescription`, if any.
pub(crate) fn apply_subscription(
    d: &Element,
    p: &mut SubscriptionProperties,
) -> Result<Option<Rule>, BadRequest> {
    let mut default_rule = None;
    for e in &d.children {
        match e.name.as_str() {
            "LockDuration" => p.lock_duration = duration(e)?,
            "RequiresSession" => p.requires_session = boolean(e)?,
            "DefaultMessageTimeToLive" => p.default_message_time_to_live = optional_duration(e)?,
            "DeadLetteringOnMessageExpiration" => {
                p.dead_lettering_on_message_expiration = boolean(e)?;
            }
            "MaxDeliveryCount" => p.max_delivery_count = number(e)?,
            "ForwardTo" => p.forward_to = forward_target(e),
            "ForwardDeadLetteredMessagesTo" => {
                p.forward_dead_lettered_messages_to = forward_target(e);
            }
            "DefaultRuleDescription" => {
                default_rule = Some(rule(e, Rule::DEFAULT_NAME)?);
            }
            _ => {
                unsupported(e)?;
            }
        }
    }
    Ok(default_rule)
}

/// A `RuleDescription`; `name` when it names none.
pub(crate) fn rule(d: &Element, name: &str) -> Result<Rule, BadRequest> {
    let name = d
        .child("Name")
        .map(|n| n.text.trim().to_owned())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| name.to_owned());
    let filter = match d.child("Filter") {
        None => Filter::True,
        Some(f) => filter(f)?,
    };
    let mut rule = Rule::new(name, filter);
    if let Some(a) = d.child("Action") {
        match a.xsi_type() {
            None | Some("EmptyRuleAction") => {}
            Some("SqlRuleAction") => {
                no_parameters(a)?;
                let text = a.child("SqlExpression").map(|e| e.text.trim()).unwrap_or_default();
                let action = SqlAction::parse(text)
                    .map_err(|e| BadRequest(format!("SqlRuleAction {text:?}: {e}")))?;
                rule = rule.with_action(action);
            }
            Some(other) => return bad(format!("the action type {other:?} is not supported")),
        }
    }
    Ok(rule)
}

fn no_parameters(e: &Element) -> Result<(), BadRequest> {
    if e.child("Parameters").is_some_and(|p| !p.children.is_empty()) {
        return bad("SQL parameters are not supported");
    }
    Ok(())
}

fn filter(f: &Element) -> Result<Filter, BadRequest> {
    Ok(match f.xsi_type() {
        Some("TrueFilter") => Filter::True,
        Some("FalseFilter") => Filter::False,
        Some("SqlFilter") | None => {
            no_parameters(f)?;
            let text = f.child("SqlExpression").map(|e| e.text.trim()).unwrap_or_default();
            Filter::Sql(
                SqlFilter::parse(text)
                    .map_err(|e| BadRequest(format!("SqlFilter {text:?}: {e}")))?,
            )
        }
        Some("CorrelationFilter") => {
            let mut c = CorrelationFilter::default();
            for e in &f.children {
                let v = Some(e.text.clone()).filter(|t| !t.is_empty());
                match e.name.as_str() {
                    "CorrelationId" => c.correlation_id = v,
                    "MessageId" => c.message_id = v,
                    "To" => c.to = v,
                    "ReplyTo" => c.reply_to = v,
                    "Label" => c.subject = v,
                    "SessionId" => c.session_id = v,
                    "ReplyToSessionId" => c.reply_to_session_id = v,
                    "ContentType" => c.content_type = v,
                    "Properties" => c.properties = key_values(e)?,
                    _ => {}
                }
            }
            Filter::Correlation(c)
        }
        Some(other) => return bad(format!("the filter type {other:?} is not supported")),
    })
}

/// `<KeyValueOfstringanyType><Key/><Value i:type="d6p1:string"/></…>` items.
fn key_values(e: &Element) -> Result<Properties, BadRequest> {
    let mut out = Properties::new();
    for kv in &e.children {
        let key = kv.child("Key").map(|k| k.text.clone()).unwrap_or_default();
        let Some(v) = kv.child("Value") else {
            return bad(format!("property {key:?} has no value"));
        };
        let t = v.text.trim();
        let parse_err =
            || BadRequest(format!("property {key:?}: {t:?} is not a {:?}", v.xsi_type()));
        let value = match v.xsi_type().unwrap_or("string") {
            "string" => Value::String(v.text.clone()),
            "int" => Value::Int(t.parse().map_err(|_| parse_err())?),
            "long" => Value::Long(t.parse().map_err(|_| parse_err())?),
            "double" => Value::Double(t.parse().map_err(|_| parse_err())?),
            "boolean" => Value::Bool(match t {
                "true" => true,
                "false" => false,
                _ => return Err(parse_err()),
            }),
            other => return bad(format!("property {key:?}: the type {other:?} is not supported")),
        };
        out.insert(key, value);
    }
    Ok(out)
}

// ----- writing -----------------------------------------------------------------------------

/// When an entity was created, changed and last used, as far as this server knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Times {
    pub(crate) created: Timestamp,
    pub(crate) updated: Timestamp,
    pub(crate) accessed: Timestamp,
}

fn ttl(d: Option<Duration>) -> String {
    d.map_or_else(|| FOREVER.to_owned(), format_duration)
}

fn el(out: &mut String, name: &str, value: impl std::fmt::Display) {
    let value = value.to_string();
    let _ = write!(out, "<{name}>{}</{name}>", escape(value.as_str()));
}

fn counts(out: &mut String, c: &MessageCounts) {
    let _ = write!(out, "<CountDetails xmlns:d2p1=\"{COUNTS_NS}\">");
    for (name, n) in [
        ("ActiveMessageCount", c.active),
        ("DeadLetterMessageCount", c.dead_letter),
        ("ScheduledMessageCount", c.scheduled),
        ("TransferDeadLetterMessageCount", 0),
        ("TransferMessageCount", 0),
    ] {
        let _ = write!(out, "<d2p1:{name}>{n}</d2p1:{name}>");
    }
    out.push_str("</CountDetails>");
}

fn total(c: &MessageCounts) -> u64 {
    c.active + c.deferred + c.scheduled + c.dead_letter
}

fn open(out: &mut String, name: &str) {
    let _ = write!(out, "<{name} xmlns=\"{SB_NS}\" xmlns:i=\"{XSI_NS}\">");
}

/// A `QueueDescription`, elements in the service's order.
pub(crate) fn queue(p: &QueueProperties, c: &MessageCounts, t: &Times) -> String {
    let mut o = String::new();
    open(&mut o, "QueueDescription");
    el(&mut o, "LockDuration", format_duration(p.lock_duration));
    el(&mut o, "MaxSizeInMegabytes", p.max_size_in_megabytes);
    el(&mut o, "RequiresDuplicateDetection", p.requires_duplicate_detection);
    el(&mut o, "RequiresSession", p.requires_session);
    el(&mut o, "DefaultMessageTimeToLive", ttl(p.default_message_time_to_live));
    el(&mut o, "DeadLetteringOnMessageExpiration", p.dead_lettering_on_message_expiration);
    el(
        &mut o,
        "DuplicateDetectionHistoryTimeWindow",
        format_duration(p.duplicate_detection_history_time_window),
    );
    el(&mut o, "MaxDeliveryCount", p.max_delivery_count);
    el(&mut o, "EnableBatchedOperations", true);
    el(&mut o, "SizeInBytes", 0);
    el(&mut o, "MessageCount", total(c));
    el(&mut o, "IsAnonymousAccessible", false);
    o.push_str("<AuthorizationRules/>");
    el(&mut o, "Status", "Active");
    el(&mut o, "CreatedAt", t.created);
    el(&mut o, "UpdatedAt", t.updated);
    el(&mut o, "AccessedAt", t.accessed);
    el(&mut o, "SupportOrdering", true);
    counts(&mut o, c);
    el(&mut o, "AutoDeleteOnIdle", FOREVER);
    el(&mut o, "EnablePartitioning", false);
    el(&mut o, "EntityAvailabilityStatus", "Available");
    el(&mut o, "EnableExpress", false);
    if let Some(f) = &p.forward_to {
        el(&mut o, "ForwardTo", f);
    }
    if let Some(f) = &p.forward_dead_lettered_messages_to {
        el(&mut o, "ForwardDeadLetteredMessagesTo", f);
    }
    o.push_str("</QueueDescription>");
    o
}

/// A `TopicDescription`.
pub(crate) fn topic(
    p: &TopicProperties,
    c: &MessageCounts,
    t: &Times,
    subscriptions: usize,
) -> String {
    let mut o = String::new();
    open(&mut o, "TopicDescription");
    el(&mut o, "DefaultMessageTimeToLive", ttl(p.default_message_time_to_live));
    el(&mut o, "MaxSizeInMegabytes", p.max_size_in_megabytes);
    el(&mut o, "RequiresDuplicateDetection", p.requires_duplicate_detection);
    el(
        &mut o,
        "DuplicateDetectionHistoryTimeWindow",
        format_duration(p.duplicate_detection_history_time_window),
    );
    el(&mut o, "EnableBatchedOperations", true);
    el(&mut o, "SizeInBytes", 0);
    el(&mut o, "FilteringMessagesBeforePublishing", false);
    el(&mut o, "IsAnonymousAccessible", false);
    o.push_str("<AuthorizationRules/>");
    el(&mut o, "Status", "Active");
    el(&mut o, "CreatedAt", t.created);
    el(&mut o, "UpdatedAt", t.updated);
    el(&mut o, "AccessedAt", t.accessed);
    el(&mut o, "SupportOrdering", true);
    counts(&mut o, c);
    el(&mut o, "SubscriptionCount", subscriptions);
    el(&mut o, "AutoDeleteOnIdle", FOREVER);
    el(&mut o, "EnablePartitioning", false);
    el(&mut o, "EntityAvailabilityStatus", "Available");
    el(&mut o, "EnableSubscriptionPartitioning", false);
    el(&mut o, "EnableExpress", false);
    o.push_str("</TopicDescription>");
    o
}

/// A `SubscriptionDescription`.
pub(crate) fn subscription(p: &SubscriptionProperties, c: &MessageCounts, t: &Times) -> String {
    let mut o = String::new();
    open(&mut o, "SubscriptionDescription");
    el(&mut o, "LockDuration", format_duration(p.lock_duration));
    el(&mut o, "RequiresSession", p.requires_session);
    el(&mut o, "DefaultMessageTimeToLive", ttl(p.default_message_time_to_live));
    el(&mut o, "DeadLetteringOnMessageExpiration", p.dead_lettering_on_message_expiration);
    el(&mut o, "DeadLetteringOnFilterEvaluationExceptions", true);
    el(&mut o, "MessageCount", total(c));
    el(&mut o, "MaxDeliveryCount", p.max_delivery_count);
    el(&mut o, "EnableBatchedOperations", true);
    el(&mut o, "Status", "Active");
    if let Some(f) = &p.forward_to {
        el(&mut o, "ForwardTo", f);
    }
    el(&mut o, "CreatedAt", t.created);
    el(&mut o, "UpdatedAt", t.updated);
    el(&mut o, "AccessedAt", t.accessed);
    counts(&mut o, c);
    if let Some(f) = &p.forward_dead_lettered_messages_to {
        el(&mut o, "ForwardDeadLetteredMessagesTo", f);
    }
    el(&mut o, "AutoDeleteOnIdle", FOREVER);
    el(&mut o, "EntityAvailabilityStatus", "Available");
    o.push_str("</SubscriptionDescription>");
    o
}

fn sql(o: &mut String, tag: &str, kind: &str, expression: &str) {
    let _ = write!(o, "<{tag} i:type=\"{kind}\">");
    el(o, "SqlExpression", expression);
    el(o, "CompatibilityLevel", 20);
    let _ = write!(o, "</{tag}>");
}

/// A `RuleDescription`.
pub(crate) fn rule_description(r: &Rule, created: Timestamp) -> String {
    let mut o = String::new();
    open(&mut o, "RuleDescription");
    rule_body(&mut o, r, created);
    o.push_str("</RuleDescription>");
    o
}

fn rule_body(o: &mut String, r: &Rule, created: Timestamp) {
    match &r.filter {
        Filter::True => sql(o, "Filter", "TrueFilter", "1=1"),
        Filter::False => sql(o, "Filter", "FalseFilter", "1=0"),
        Filter::Sql(s) => sql(o, "Filter", "SqlFilter", s.expression()),
        Filter::Correlation(c) => {
            o.push_str("<Filter i:type=\"CorrelationFilter\">");
            for (name, v) in [
                ("CorrelationId", &c.correlation_id),
                ("MessageId", &c.message_id),
                ("To", &c.to),
                ("ReplyTo", &c.reply_to),
                ("Label", &c.subject),
                ("SessionId", &c.session_id),
                ("ReplyToSessionId", &c.reply_to_session_id),
                ("ContentType", &c.content_type),
            ] {
                if let Some(v) = v {
                    el(o, name, v);
                }
            }
            o.push_str("<Properties>");
            for (k, v) in &c.properties {
                let (kind, text) = match v {
                    Value::Bool(b) => ("boolean", b.to_string()),
                    Value::Int(n) => ("int", n.to_string()),
                    Value::Long(n) => ("long", n.to_string()),
                    Value::Double(x) => ("double", x.to_string()),
                    other => (
                        "string",
                        other.as_str().map_or_else(|| format!("{other:?}"), str::to_owned),
                    ),
                };
                o.push_str("<KeyValueOfstringanyType>");
                el(o, "Key", k);
                let _ = write!(
                    o,
                    "<Value i:type=\"d6p1:{kind}\" xmlns:d6p1=\"http://www.w3.org/2001/XMLSchema\">{}</Value>",
                    escape(text.as_str())
                );
                o.push_str("</KeyValueOfstringanyType>");
            }
            o.push_str("</Properties></Filter>");
        }
        _ => sql(o, "Filter", "FalseFilter", "1=0"),
    }
    match &r.action {
        Some(a) => sql(o, "Action", "SqlRuleAction", a.expression()),
        None => o.push_str("<Action i:type=\"EmptyRuleAction\"/>"),
    }
    el(o, "CreatedAt", created);
    el(o, "Name", &r.name);
}

/// An ATOM `<entry>` around a description; `path` is the entity's path as the service spells
/// it (`t/Subscriptions/s/Rules/r`).
pub(crate) fn entry(base: &str, path: &str, title: &str, t: &Times, description: &str) -> String {
    let mut o = String::from("<?xml version=\"1.0\" encoding=\"utf-8\"?>");
    entry_into(&mut o, base, path, title, t, description, true);
    o
}

fn entry_into(
    o: &mut String,
    base: &str,
    path: &str,
    title: &str,
    t: &Times,
    description: &str,
    with_ns: bool,
) {
    let url = format!("{base}/{path}?api-version=2021-05");
    if with_ns {
        o.push_str("<entry xmlns=\"http://www.w3.org/2005/Atom\">");
    } else {
        o.push_str("<entry>");
    }
    el(o, "id", &url);
    let _ = write!(o, "<title type=\"text\">{}</title>", escape(title));
    el(o, "published", t.created);
    el(o, "updated", t.updated);
    o.push_str("<author><name>twice</name></author>");
    let _ = write!(o, "<link rel=\"self\" href=\"{}\"/>", escape(url.as_str()));
    o.push_str("<content type=\"application/xml\">");
    o.push_str(description);
    o.push_str("</content></entry>");
}

/// One entry of a feed: its path, title, times and description.
pub(crate) struct FeedEntry {
    pub(crate) path: String,
    pub(crate) title: String,
    pub(crate) times: Times,
    pub(crate) description: String,
}

/// An ATOM `<feed>` of one page; `next` is the `$skip` of the next page, if there is one.
pub(crate) fn feed(
    base: &str,
    path: &str,
    title: &str,
    now: Timestamp,
    entries: &[FeedEntry],
    next: Option<(usize, usize)>,
) -> String {
    let mut o = String::from(
        "<?xml version=\"1.0\" encoding=\"utf-8\"?><feed xmlns=\"http://www.w3.org/2005/Atom\">",
    );
    let _ = write!(o, "<title type=\"text\">{}</title>", escape(title));
    let url = format!("{base}/{path}?api-version=2021-05");
    el(&mut o, "id", &url);
    el(&mut o, "updated", now);
    let _ = write!(o, "<link rel=\"self\" href=\"{}\"/>", escape(url.as_str()));
    if let Some((skip, top)) = next {
        let next = format!("{base}/{path}?$skip={skip}&$top={top}&api-version=2021-05");
        let _ = write!(o, "<link rel=\"next\" href=\"{}\"/>", escape(next.as_str()));
    }
    for e in entries {
        entry_into(&mut o, base, &e.path, &e.title, &e.times, &e.description, false);
    }
    o.push_str("</feed>");
    o
}

/// The error body Service Bus sends.
pub(crate) fn error(code: u16, detail: &str) -> String {
    format!("<Error><Code>{code}</Code><Detail>{}</Detail></Error>", escape(detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PY_QUEUE: &str = r#"<?xml version='1.0' encoding='utf-8'?>
<ns0:entry xmlns:ns0="http://www.w3.org/2005/Atom"><ns0:content type="application/xml"><QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect"><LockDuration>PT30S</LockDuration><MaxSizeInMegabytes>2048</MaxSizeInMegabytes><RequiresSession>true</RequiresSession><DefaultMessageTimeToLive>P10675199DT2H48M5.4775807S</DefaultMessageTimeToLive><MaxDeliveryCount>7</MaxDeliveryCount><ForwardTo>sb://localhost:5300/q2</ForwardTo></QueueDescription></ns0:content></ns0:entry>"#;

    fn queue_of(body: &str) -> Result<QueueProperties, BadRequest> {
        let Description::Queue(d) = description(body.as_bytes())? else { panic!("not a queue") };
        let mut p = QueueProperties::default();
        apply_queue(&d, &mut p)?;
        Ok(p)
    }

    #[test]
    fn a_python_queue_body_sets_what_it_names_and_leaves_the_cloud_defaults() {
        let p = queue_of(PY_QUEUE).unwrap();
        assert_eq!(p.lock_duration, Duration::from_secs(30));
        assert_eq!(p.max_size_in_megabytes, 2048);
        assert!(p.requires_session);
        assert_eq!(p.default_message_time_to_live, None, "TimeSpan.MaxValue is forever");
        assert_eq!(p.max_delivery_count, 7);
        assert_eq!(p.forward_to.as_deref(), Some("q2"));
        let d = QueueProperties::default();
        assert_eq!(
            p.duplicate_detection_history_time_window,
            d.duplicate_detection_history_time_window
        );
        assert!(!p.requires_duplicate_detection);
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        for (body, why) in [
            ("<entry><content>", "ends inside"),
            ("not xml at all", "no XML element"),
            ("<feed/>", "not an ATOM <entry>"),
            ("<entry/>", "no <content>"),
            ("<entry><content><Foo/></content></entry>", "<Foo> is not"),
            (
                "<entry><content><QueueDescription><MaxDeliveryCount>x</MaxDeliveryCount></QueueDescription></content></entry>",
                "MaxDeliveryCount: \"x\" is not a number",
            ),
            (
                "<entry><content><QueueDescription><LockDuration>1 minute</LockDuration></QueueDescription></content></entry>",
                "LockDuration:",
            ),
            (
                "<entry><content><QueueDescription><AutoDeleteOnIdle>PT1H</AutoDeleteOnIdle></QueueDescription></content></entry>",
                "AutoDeleteOnIdle = \"PT1H\" is not supported",
            ),
            (
                "<entry><content><QueueDescription><EnablePartitioning>true</EnablePartitioning></QueueDescription></content></entry>",
                "EnablePartitioning",
            ),
        ] {
            let err = queue_of(body).unwrap_err();
            assert!(err.0.contains(why), "{body}: {err}");
        }
        let deep = "<a>".repeat(40) + &"</a>".repeat(40);
        assert!(parse(deep.as_bytes()).unwrap_err().0.contains("nests deeper than"));
    }

    #[test]
    fn documents_past_the_caps_are_refused_naming_the_limit() {
        let attrs: String = (0..65).map(|i| format!(" a{i}=\"\"")).collect();
        let body = format!("<entry><content><QueueDescription{attrs}/></content></entry>");
        let err = parse(body.as_bytes()).unwrap_err();
        assert!(err.0.contains("more than 64 attributes"), "{err}");
        let attrs: String = (0..64).map(|i| format!(" a{i}=\"\"")).collect();
        assert!(parse(format!("<entry{attrs}/>").as_bytes()).is_ok());
        let body = format!("<entry>{}</entry>", "<a/>".repeat(4096));
        let err = parse(body.as_bytes()).unwrap_err();
        assert!(err.0.contains("more than 4096 elements"), "{err}");
        let body = format!("<entry>{}</entry>", "<a/>".repeat(4095));
        assert!(parse(body.as_bytes()).is_ok());
        let deep = "<a>".repeat(33) + &"</a>".repeat(33);
        let err = parse(deep.as_bytes()).unwrap_err();
        assert!(err.0.contains("nests deeper than 32 elements"), "{err}");
    }

    #[test]
    fn a_sql_rule_with_an_action_parses_and_writes_back() {
        let body = r#"<entry xmlns="http://www.w3.org/2005/Atom"><content type="application/xml"><RuleDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect" xmlns:p4="http://www.w3.org/2001/XMLSchema-instance"><Filter p4:type="SqlFilter"><SqlExpression>color = 'red' AND n &gt; 2</SqlExpression></Filter><Action p4:type="SqlRuleAction"><SqlExpression>SET seen = 1</SqlExpression></Action><Name>reds</Name></RuleDescription></content></entry>"#;
        let Description::Rule(d) = description(body.as_bytes()).unwrap() else { panic!() };
        let r = rule(&d, "x").unwrap();
        assert_eq!(r.name, "reds");
        let Filter::Sql(f) = &r.filter else { panic!("{:?}", r.filter) };
        assert_eq!(f.expression(), "color = 'red' AND n > 2");
        assert_eq!(r.action.as_ref().map(SqlAction::expression), Some("SET seen = 1"));
        let xml = rule_description(&r, Timestamp::from_millis(0));
        assert!(xml.contains(
            "<Filter i:type=\"SqlFilter\"><SqlExpression>color = &apos;red&apos; AND n &gt; 2</SqlExpression><CompatibilityLevel>20</CompatibilityLevel></Filter><Action i:type=\"SqlRuleAction\"><SqlExpression>SET seen = 1</SqlExpression>"
        ), "{xml}");
        // What was written reads back to the same rule.
        let again = format!("<entry><content>{xml}</content></entry>");
        let Description::Rule(d) = description(again.as_bytes()).unwrap() else { panic!() };
        assert_eq!(rule(&d, "x").unwrap(), r);
    }

    #[test]
    fn a_correlation_rule_keeps_its_typed_properties() {
        let body = r#"<entry><content><RuleDescription xmlns:i="http://www.w3.org/2001/XMLSchema-instance"><Filter i:type="CorrelationFilter"><CorrelationId>c1</CorrelationId><Label>s</Label><Properties><KeyValueOfstringanyType><Key>n</Key><Value i:type="d6p1:int" xmlns:d6p1="http://www.w3.org/2001/XMLSchema">5</Value></KeyValueOfstringanyType><KeyValueOfstringanyType><Key>k</Key><Value i:type="d6p1:string" xmlns:d6p1="http://www.w3.org/2001/XMLSchema">v</Value></KeyValueOfstringanyType></Properties></Filter><Action i:type="EmptyRuleAction"/><Name>corr</Name></RuleDescription></content></entry>"#;
        let Description::Rule(d) = description(body.as_bytes()).unwrap() else { panic!() };
        let r = rule(&d, "x").unwrap();
        let Filter::Correlation(c) = &r.filter else { panic!() };
        assert_eq!(c.correlation_id.as_deref(), Some("c1"));
        assert_eq!(c.subject.as_deref(), Some("s"));
        assert_eq!(c.properties.get("n"), Some(&Value::Int(5)));
        assert_eq!(c.properties.get("k"), Some(&Value::String("v".into())));
        assert!(r.action.is_none());
        let xml = rule_description(&r, Timestamp::from_millis(0));
        let again = format!("<entry><content>{xml}</content></entry>");
        let Description::Rule(d) = description(again.as_bytes()).unwrap() else { panic!() };
        assert_eq!(rule(&d, "x").unwrap(), r);
    }

    #[test]
    fn a_queue_entry_has_the_service_order_and_counts() {
        let t = Times {
            created: Timestamp::from_millis(0),
            updated: Timestamp::from_millis(1000),
            accessed: Timestamp::from_millis(2000),
        };
        let mut c = MessageCounts::default();
        c.active = 3;
        c.dead_letter = 1;
        let d = queue(&QueueProperties::default(), &c, &t);
        let order = [
            "<LockDuration>PT1M</LockDuration>",
            "<MaxSizeInMegabytes>1024<",
            "<RequiresDuplicateDetection>",
            "<RequiresSession>",
            "<DefaultMessageTimeToLive>P10675199DT2H48M5.4775807S<",
            "<DeadLetteringOnMessageExpiration>",
            "<DuplicateDetectionHistoryTimeWindow>PT10M<",
            "<MaxDeliveryCount>10<",
            "<MessageCount>4<",
            "<CreatedAt>1970-01-01T00:00:00.000Z<",
            "<d2p1:ActiveMessageCount>3<",
            "<d2p1:DeadLetterMessageCount>1<",
            "<EnableExpress>",
        ];
        let mut at = 0;
        for part in order {
            let i = d[at..].find(part).unwrap_or_else(|| panic!("{part} not after {at} in {d}"));
            at += i;
        }
        let e = entry("https://localhost:1", "q1", "q1", &t, &d);
        let root = parse(e.as_bytes()).unwrap();
        assert_eq!(root.name, "entry");
        assert_eq!(root.child("id").unwrap().text, "https://localhost:1/q1?api-version=2021-05");
        assert_eq!(root.child("title").unwrap().text, "q1");
        // What was written reads back as the same properties.
        let mut p = QueueProperties::default();
        let Description::Queue(desc) = description(e.as_bytes()).unwrap() else { panic!() };
        apply_queue(&desc, &mut p).unwrap();
        assert_eq!(p, QueueProperties::default());
    }

    #[test]
    fn a_feed_links_its_next_page() {
        let f = feed(
            "https://h",
            "$Resources/queues",
            "Queues",
            Timestamp::from_millis(0),
            &[],
            Some((2, 2)),
        );
        let root = parse(f.as_bytes()).unwrap();
        let next = root
            .children
            .iter()
            .find(|c| c.name == "link" && c.attr("rel") == Some("next"))
            .unwrap();
        assert_eq!(
            next.attr("href"),
            Some("https://h/$Resources/queues?$skip=2&$top=2&api-version=2021-05")
        );
    }
}
