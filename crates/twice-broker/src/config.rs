//! Entities and their properties, and the official Service Bus emulator's `Config.json`.
//!
//! An entity is a queue, a topic, or a subscription of a topic, each declared by an
//! [`EntityDefinition`]. Properties carry the Service Bus names, defaults and ranges:
//!
//! | property | default | range |
//! |---|---|---|
//! | `LockDuration` | `PT1M` | 5 s to 5 min |
//! | `MaxDeliveryCount` | 10 | at least 1 |
//! | `DefaultMessageTimeToLive` | none (messages live until settled) | at least 1 s |
//! | `DeadLetteringOnMessageExpiration` | `false` | |
//! | `RequiresDuplicateDetection` | `false` | fixed at creation |
//! | `DuplicateDetectionHistoryTimeWindow` | `PT10M` | 20 s to 7 days |
//! | `RequiresSession` | `false` | fixed at creation |
//! | `ForwardTo`, `ForwardDeadLetteredMessagesTo` | none | a queue or topic name |
//!
//! [`Config::from_json`] reads the emulator's file format (`UserConfig` → `Namespaces[]` →
//! `Queues[]` / `Topics[]` → `Subscriptions[]` → `Rules[]`, each with `Name` and `Properties`),
//! comments included, so a file written for the emulator works unchanged. Its namespace name is
//! not checked. Every error names the JSON path of the value it rejects.
//!
//! ```
//! use twice_broker::config::Config;
//!
//! let config = Config::from_json(r#"{
//!   "UserConfig": {
//!     "Namespaces": [{
//!       "Name": "sbemulatorns",
//!       "Queues": [{ "Name": "orders", "Properties": { "LockDuration": "PT30S" } }],
//!       "Topics": []
//!     }],
//!     "Logging": { "Type": "Console" }
//!   }
//! }"#)?;
//! let entities = config.entities()?;
//! assert_eq!(entities[0].path(), "orders");
//! # Ok::<(), twice_broker::Error>(())
//! ```

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};
use twice::{Message, Properties, Value};

use crate::error::Error;

/// The shortest lock a queue or subscription may have.
pub const MIN_LOCK_DURATION: Duration = Duration::from_secs(5);
/// The longest lock a queue or subscription may have.
pub const MAX_LOCK_DURATION: Duration = Duration::from_secs(5 * 60);
/// The shortest duplicate-detection window.
pub const MIN_DUPLICATE_DETECTION_WINDOW: Duration = Duration::from_secs(20);
/// The longest duplicate-detection window.
pub const MAX_DUPLICATE_DETECTION_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// The shortest default time to live of an entity.
pub const MIN_DEFAULT_TIME_TO_LIVE: Duration = Duration::from_secs(1);
/// The longest queue or topic name (a subscription's or rule's name has its own limit).
pub const MAX_ENTITY_NAME_LEN: usize = 260;
/// The longest subscription or rule name.
pub const MAX_SUBSCRIPTION_NAME_LEN: usize = 50;

/// The properties of a queue. `Default` gives the Service Bus defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct QueueProperties {
    /// How long a peek-lock lasts (`LockDuration`).
    pub lock_duration: Duration,
    /// Deliveries before a message is dead-lettered (`MaxDeliveryCount`).
    pub max_delivery_count: u32,
    /// The longest a message lives; `None` is forever (`DefaultMessageTimeToLive`).
    pub default_message_time_to_live: Option<Duration>,
    /// Whether expired messages go to the dead-letter queue instead of being dropped
    /// (`DeadLetteringOnMessageExpiration`).
    pub dead_lettering_on_message_expiration: bool,
    /// Whether a re-sent message id is dropped within the window
    /// (`RequiresDuplicateDetection`; fixed at creation).
    pub requires_duplicate_detection: bool,
    /// The duplicate-detection window (`DuplicateDetectionHistoryTimeWindow`).
    pub duplicate_detection_history_time_window: Duration,
    /// Whether messages must carry a session id (`RequiresSession`; fixed at creation).
    pub requires_session: bool,
    /// A queue or topic every message is moved to on arrival (`ForwardTo`).
    pub forward_to: Option<String>,
    /// A queue or topic dead-lettered messages go to instead of the dead-letter queue
    /// (`ForwardDeadLetteredMessagesTo`).
    pub forward_dead_lettered_messages_to: Option<String>,
}

impl Default for QueueProperties {
    fn default() -> Self {
        Self {
            lock_duration: Duration::from_secs(60),
            max_delivery_count: 10,
            default_message_time_to_live: None,
            dead_lettering_on_message_expiration: false,
            requires_duplicate_detection: false,
            duplicate_detection_history_time_window: Duration::from_secs(600),
            requires_session: false,
            forward_to: None,
            forward_dead_lettered_messages_to: None,
        }
    }
}

impl QueueProperties {
    /// Sets `LockDuration`.
    #[must_use]
    pub fn with_lock_duration(mut self, d: Duration) -> Self {
        self.lock_duration = d;
        self
    }

    /// Sets `MaxDeliveryCount`.
    #[must_use]
    pub fn with_max_delivery_count(mut self, n: u32) -> Self {
        self.max_delivery_count = n;
        self
    }

    /// Sets `DefaultMessageTimeToLive`.
    #[must_use]
    pub fn with_default_message_time_to_live(mut self, d: Duration) -> Self {
        self.default_message_time_to_live = Some(d);
        self
    }

    /// Sets `DeadLetteringOnMessageExpiration`.
    #[must_use]
    pub fn with_dead_lettering_on_message_expiration(mut self, on: bool) -> Self {
        self.dead_lettering_on_message_expiration = on;
        self
    }

    /// Turns duplicate detection on with this window.
    #[must_use]
    pub fn with_duplicate_detection(mut self, window: Duration) -> Self {
        self.requires_duplicate_detection = true;
        self.duplicate_detection_history_time_window = window;
        self
    }

    /// Sets `RequiresSession`.
    #[must_use]
    pub fn with_requires_session(mut self, on: bool) -> Self {
        self.requires_session = on;
        self
    }

    /// Sets `ForwardTo`.
    #[must_use]
    pub fn with_forward_to(mut self, to: impl Into<String>) -> Self {
        self.forward_to = Some(to.into());
        self
    }

    /// Sets `ForwardDeadLetteredMessagesTo`.
    #[must_use]
    pub fn with_forward_dead_lettered_messages_to(mut self, to: impl Into<String>) -> Self {
        self.forward_dead_lettered_messages_to = Some(to.into());
        self
    }

    /// Checks every property against its range.
    pub fn validate(&self) -> Result<(), Error> {
        validate_lock_duration(self.lock_duration)?;
        validate_max_delivery_count(self.max_delivery_count)?;
        validate_ttl(self.default_message_time_to_live)?;
        validate_dedup_window(self.duplicate_detection_history_time_window)?;
        validate_forward("ForwardTo", self.forward_to.as_deref())?;
        validate_forward(
            "ForwardDeadLetteredMessagesTo",
            self.forward_dead_lettered_messages_to.as_deref(),
        )
    }
}

/// The properties of a topic. `Default` gives the Service Bus defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TopicProperties {
    /// The longest a message lives; `None` is forever (`DefaultMessageTimeToLive`).
    pub default_message_time_to_live: Option<Duration>,
    /// Whether a re-sent message id is dropped within the window
    /// (`RequiresDuplicateDetection`; fixed at creation).
    pub requires_duplicate_detection: bool,
    /// The duplicate-detection window (`DuplicateDetectionHistoryTimeWindow`).
    pub duplicate_detection_history_time_window: Duration,
}

impl Default for TopicProperties {
    fn default() -> Self {
        Self {
            default_message_time_to_live: None,
            requires_duplicate_detection: false,
            duplicate_detection_history_time_window: Duration::from_secs(600),
        }
    }
}

impl TopicProperties {
    /// Sets `DefaultMessageTimeToLive`.
    #[must_use]
    pub fn with_default_message_time_to_live(mut self, d: Duration) -> Self {
        self.default_message_time_to_live = Some(d);
        self
    }

    /// Turns duplicate detection on with this window.
    #[must_use]
    pub fn with_duplicate_detection(mut self, window: Duration) -> Self {
        self.requires_duplicate_detection = true;
        self.duplicate_detection_history_time_window = window;
        self
    }

    /// Checks every property against its range.
    pub fn validate(&self) -> Result<(), Error> {
        validate_ttl(self.default_message_time_to_live)?;
        validate_dedup_window(self.duplicate_detection_history_time_window)
    }
}

/// The properties of a subscription. `Default` gives the Service Bus defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SubscriptionProperties {
    /// How long a peek-lock lasts (`LockDuration`).
    pub lock_duration: Duration,
    /// Deliveries before a message is dead-lettered (`MaxDeliveryCount`).
    pub max_delivery_count: u32,
    /// The longest a message lives; `None` is forever (`DefaultMessageTimeToLive`).
    pub default_message_time_to_live: Option<Duration>,
    /// Whether expired messages go to the dead-letter queue instead of being dropped.
    pub dead_lettering_on_message_expiration: bool,
    /// Whether messages must carry a session id (fixed at creation).
    pub requires_session: bool,
    /// A queue or topic every message is moved to on arrival (`ForwardTo`).
    pub forward_to: Option<String>,
    /// A queue or topic dead-lettered messages go to (`ForwardDeadLetteredMessagesTo`).
    pub forward_dead_lettered_messages_to: Option<String>,
}

impl Default for SubscriptionProperties {
    fn default() -> Self {
        Self {
            lock_duration: Duration::from_secs(60),
            max_delivery_count: 10,
            default_message_time_to_live: None,
            dead_lettering_on_message_expiration: false,
            requires_session: false,
            forward_to: None,
            forward_dead_lettered_messages_to: None,
        }
    }
}

impl SubscriptionProperties {
    /// Sets `LockDuration`.
    #[must_use]
    pub fn with_lock_duration(mut self, d: Duration) -> Self {
        self.lock_duration = d;
        self
    }

    /// Sets `MaxDeliveryCount`.
    #[must_use]
    pub fn with_max_delivery_count(mut self, n: u32) -> Self {
        self.max_delivery_count = n;
        self
    }

    /// Sets `DefaultMessageTimeToLive`.
    #[must_use]
    pub fn with_default_message_time_to_live(mut self, d: Duration) -> Self {
        self.default_message_time_to_live = Some(d);
        self
    }

    /// Sets `DeadLetteringOnMessageExpiration`.
    #[must_use]
    pub fn with_dead_lettering_on_message_expiration(mut self, on: bool) -> Self {
        self.dead_lettering_on_message_expiration = on;
        self
    }

    /// Sets `RequiresSession`.
    #[must_use]
    pub fn with_requires_session(mut self, on: bool) -> Self {
        self.requires_session = on;
        self
    }

    /// Sets `ForwardTo`.
    #[must_use]
    pub fn with_forward_to(mut self, to: impl Into<String>) -> Self {
        self.forward_to = Some(to.into());
        self
    }

    /// Sets `ForwardDeadLetteredMessagesTo`.
    #[must_use]
    pub fn with_forward_dead_lettered_messages_to(mut self, to: impl Into<String>) -> Self {
        self.forward_dead_lettered_messages_to = Some(to.into());
        self
    }

    /// Checks every property against its range.
    pub fn validate(&self) -> Result<(), Error> {
        validate_lock_duration(self.lock_duration)?;
        validate_max_delivery_count(self.max_delivery_count)?;
        validate_ttl(self.default_message_time_to_live)?;
        validate_forward("ForwardTo", self.forward_to.as_deref())?;
        validate_forward(
            "ForwardDeadLetteredMessagesTo",
            self.forward_dead_lettered_messages_to.as_deref(),
        )
    }
}

/// A subscription rule: a message sent to the topic is copied to the subscription when any of
/// its rules' filters matches (once, however many match).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Rule {
    /// The rule name.
    pub name: String,
    /// Which messages it selects.
    pub filter: Filter,
}

impl Rule {
    /// The name of the rule a subscription gets when it is created without rules.
    pub const DEFAULT_NAME: &'static str = "$Default";

    /// A rule with this name and filter.
    pub fn new(name: impl Into<String>, filter: Filter) -> Self {
        Self { name: name.into(), filter }
    }

    /// The rule every subscription gets when none is given: `$Default`, matching everything.
    pub fn default_rule() -> Self {
        Self::new(Self::DEFAULT_NAME, Filter::True)
    }
}

/// The filter of a rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Filter {
    /// Matches every message.
    True,
    /// Matches no message.
    False,
    /// Matches messages whose properties equal the filter's.
    Correlation(CorrelationFilter),
    /// A SQL filter expression. Not supported yet: creating a rule with one is an error.
    Sql(String),
}

impl Filter {
    /// Whether the filter selects the message.
    pub fn matches(&self, message: &Message) -> bool {
        match self {
            Filter::True => true,
            Filter::False | Filter::Sql(_) => false,
            Filter::Correlation(c) => c.matches(message),
        }
    }
}

/// A correlation filter: every field that is set must equal the message's (strings compare
/// exactly; numbers compare by value).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CorrelationFilter {
    /// `MessageId`.
    pub message_id: Option<String>,
    /// `CorrelationId`.
    pub correlation_id: Option<String>,
    /// `SessionId`.
    pub session_id: Option<String>,
    /// `Label` (the message's subject).
    pub subject: Option<String>,
    /// `To`.
    pub to: Option<String>,
    /// `ReplyTo`.
    pub reply_to: Option<String>,
    /// `ReplyToSessionId`.
    pub reply_to_session_id: Option<String>,
    /// `ContentType`.
    pub content_type: Option<String>,
    /// Application properties that must be present with these values.
    pub properties: Properties,
}

impl CorrelationFilter {
    /// Whether the message matches every field that is set.
    pub fn matches(&self, m: &Message) -> bool {
        fn eq(want: Option<&String>, have: Option<&str>) -> bool {
            want.is_none_or(|w| have == Some(w.as_str()))
        }
        eq(self.message_id.as_ref(), m.message_id.as_ref().map(|id| id.as_str()))
            && eq(self.correlation_id.as_ref(), m.correlation_id.as_deref())
            && eq(self.session_id.as_ref(), m.session_id.as_ref().map(|id| id.as_str()))
            && eq(self.subject.as_ref(), m.subject.as_deref())
            && eq(self.to.as_ref(), m.to.as_deref())
            && eq(self.reply_to.as_ref(), m.reply_to.as_deref())
            && eq(self.reply_to_session_id.as_ref(), m.reply_to_session_id.as_deref())
            && eq(self.content_type.as_ref(), m.content_type.as_deref())
            && self.properties.iter().all(|(k, want)| {
                m.application_properties.get(k).is_some_and(|have| values_match(want, have))
            })
    }
}

/// Filter equality: strings and symbols by content, numbers by value across integer widths
/// (a filter read from JSON holds `Long` or `Double` whatever type the sender used).
fn values_match(want: &Value, have: &Value) -> bool {
    if let (Some(a), Some(b)) = (want.as_str(), have.as_str()) {
        return a == b;
    }
    if let (Some(a), Some(b)) = (as_integer(want), as_integer(have)) {
        return a == b;
    }
    if let (Some(a), Some(b)) = (as_float(want), as_float(have)) {
        return a == b;
    }
    want == have
}

fn as_integer(v: &Value) -> Option<i128> {
    Some(match *v {
        Value::Ubyte(n) => n.into(),
        Value::Ushort(n) => n.into(),
        Value::Uint(n) => n.into(),
        Value::Ulong(n) => n.into(),
        Value::Byte(n) => n.into(),
        Value::Short(n) => n.into(),
        Value::Int(n) => n.into(),
        Value::Long(n) => n.into(),
        _ => return None,
    })
}

fn as_float(v: &Value) -> Option<f64> {
    match *v {
        Value::Float(x) => Some(x.into()),
        Value::Double(x) => Some(x),
        // An integer compares with a float by value, so `1` matches `1.0`.
        _ => as_integer(v).map(|n| n as f64),
    }
}

/// The definition of an entity: what is needed to create it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EntityDefinition {
    /// A queue.
    Queue {
        /// Its name (the path of the entity).
        name: String,
        /// Its properties.
        properties: QueueProperties,
    },
    /// A topic.
    Topic {
        /// Its name.
        name: String,
        /// Its properties.
        properties: TopicProperties,
    },
    /// A subscription of a topic.
    Subscription {
        /// The topic's name.
        topic: String,
        /// The subscription's name (unique within the topic).
        name: String,
        /// Its properties.
        properties: SubscriptionProperties,
        /// Its rules. A subscription created (or declared in a configuration) without rules
        /// gets the `$Default` rule, which matches everything, as in Service Bus; one whose
        /// rules were all deleted, or that is updated with none, has no rules and receives
        /// nothing.
        rules: Vec<Rule>,
    },
}

impl EntityDefinition {
    /// A queue definition.
    pub fn queue(name: impl Into<String>, properties: QueueProperties) -> Self {
        Self::Queue { name: name.into(), properties }
    }

    /// A topic definition.
    pub fn topic(name: impl Into<String>, properties: TopicProperties) -> Self {
        Self::Topic { name: name.into(), properties }
    }

    /// A subscription definition.
    pub fn subscription(
        topic: impl Into<String>,
        name: impl Into<String>,
        properties: SubscriptionProperties,
        rules: Vec<Rule>,
    ) -> Self {
        Self::Subscription { topic: topic.into(), name: name.into(), properties, rules }
    }

    /// The entity path: the queue or topic name, or `<topic>/Subscriptions/<name>`.
    pub fn path(&self) -> String {
        match self {
            Self::Queue { name, .. } | Self::Topic { name, .. } => name.clone(),
            Self::Subscription { topic, name, .. } => format!("{topic}/Subscriptions/{name}"),
        }
    }

    /// Checks names, property ranges and rules.
    pub fn validate(&self) -> Result<(), Error> {
        match self {
            Self::Queue { name, properties } => {
                validate_entity_name(name)?;
                properties.validate()
            }
            Self::Topic { name, properties } => {
                validate_entity_name(name)?;
                properties.validate()
            }
            Self::Subscription { topic, name, properties, rules } => {
                validate_entity_name(topic)?;
                validate_subscription_name(name)?;
                properties.validate()?;
                for (i, rule) in rules.iter().enumerate() {
                    if rule.name != Rule::DEFAULT_NAME {
                        validate_subscription_name(&rule.name)?;
                    }
                    if rules[..i].iter().any(|r| r.name.eq_ignore_ascii_case(&rule.name)) {
                        return Err(Error::InvalidArgument(format!(
                            "rule {:?} appears twice",
                            rule.name
                        )));
                    }
                    if matches!(rule.filter, Filter::Sql(_)) {
                        return Err(Error::NotSupported("SQL filters"));
                    }
                }
                Ok(())
            }
        }
    }
}

/// Checks a queue or topic name: 1 to 260 letters, digits, `.`, `-`, `_` and `/`, starting
/// and ending with a letter or digit, with no empty path segment and no segment named
/// `Subscriptions` (which would make `<topic>/Subscriptions/<name>` paths ambiguous).
pub fn validate_entity_name(name: &str) -> Result<(), Error> {
    let bad = |reason| Err(Error::InvalidEntityName { name: name.to_owned(), reason });
    if name.is_empty() || name.len() > MAX_ENTITY_NAME_LEN {
        return bad("a queue or topic name has 1 to 260 characters");
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '/')) {
        return bad("a queue or topic name has only letters, digits, '.', '-', '_' and '/'");
    }
    if !starts_and_ends_alphanumeric(name) {
        return bad("a name starts and ends with a letter or digit");
    }
    if name.split('/').any(|s| s.is_empty() || s.eq_ignore_ascii_case("subscriptions")) {
        return bad("a path segment is empty or named 'Subscriptions'");
    }
    Ok(())
}

/// Checks a subscription or rule name: 1 to 50 letters, digits, `.`, `-` and `_`, starting and
/// ending with a letter or digit.
pub fn validate_subscription_name(name: &str) -> Result<(), Error> {
    let bad = |reason| Err(Error::InvalidEntityName { name: name.to_owned(), reason });
    if name.is_empty() || name.len() > MAX_SUBSCRIPTION_NAME_LEN {
        return bad("a subscription or rule name has 1 to 50 characters");
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')) {
        return bad("a subscription or rule name has only letters, digits, '.', '-' and '_'");
    }
    if !starts_and_ends_alphanumeric(name) {
        return bad("a name starts and ends with a letter or digit");
    }
    Ok(())
}

fn starts_and_ends_alphanumeric(name: &str) -> bool {
    let b = name.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
}

fn validate_lock_duration(d: Duration) -> Result<(), Error> {
    check_range("LockDuration", d, MIN_LOCK_DURATION, MAX_LOCK_DURATION)
}

fn validate_max_delivery_count(n: u32) -> Result<(), Error> {
    if n == 0 {
        return Err(Error::InvalidProperty {
            property: "MaxDeliveryCount",
            reason: "must be at least 1".to_owned(),
        });
    }
    Ok(())
}

fn validate_ttl(d: Option<Duration>) -> Result<(), Error> {
    match d {
        Some(d) if d < MIN_DEFAULT_TIME_TO_LIVE => Err(Error::InvalidProperty {
            property: "DefaultMessageTimeToLive",
            reason: format!("{} is shorter than the minimum PT1S", format_duration(d)),
        }),
        _ => Ok(()),
    }
}

fn validate_dedup_window(d: Duration) -> Result<(), Error> {
    check_range(
        "DuplicateDetectionHistoryTimeWindow",
        d,
        MIN_DUPLICATE_DETECTION_WINDOW,
        MAX_DUPLICATE_DETECTION_WINDOW,
    )
}

fn validate_forward(property: &'static str, to: Option<&str>) -> Result<(), Error> {
    match to {
        Some(to) => validate_entity_name(to)
            .map_err(|e| Error::InvalidProperty { property, reason: e.to_string() }),
        None => Ok(()),
    }
}

fn check_range(
    property: &'static str,
    d: Duration,
    min: Duration,
    max: Duration,
) -> Result<(), Error> {
    if d < min || d > max {
        return Err(Error::InvalidProperty {
            property,
            reason: format!(
                "{} is outside {}..={}",
                format_duration(d),
                format_duration(min),
                format_duration(max)
            ),
        });
    }
    Ok(())
}

/// Parses an ISO-8601 duration: `P[nY][nM][nW][nD][T[nH][nM][nS]]`, e.g. `PT1M`, `P7D`,
/// `PT10M30S`, `PT0.5S`. A year counts 365 days and a month 30 days, as .NET's
/// `XmlConvert.ToTimeSpan` does. Any component may have a decimal fraction.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not an ISO-8601 duration such as PT1M, PT30S or P7D");
    let rest = s.strip_prefix('P').ok_or_else(bad)?;
    if rest.is_empty() {
        return Err(bad());
    }
    const SEC: u128 = 1_000_000_000;
    let mut total: u128 = 0;
    let mut in_time = false;
    let mut components = 0;
    // Order of the designators seen so far, so that `PT1S1M` is rejected.
    let mut last_rank = 0;
    let mut chars = rest.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if c == 'T' {
            if in_time {
                return Err(bad());
            }
            in_time = true;
            chars.next();
            if chars.peek().is_none() {
                return Err(bad());
            }
            continue;
        }
        let mut end = start;
        while let Some(&(i, c)) = chars.peek() {
            if c.is_ascii_digit() || c == '.' || c == ',' {
                end = i + c.len_utf8();
                chars.next();
            } else {
                break;
            }
        }
        let number = &rest[start..end];
        let (_, unit) = chars.next().ok_or_else(bad)?;
        if number.is_empty() {
            return Err(bad());
        }
        let (rank, unit_nanos) = match (in_time, unit) {
            (false, 'Y') => (1, 365 * 86_400 * SEC),
            (false, 'M') => (2, 30 * 86_400 * SEC),
            (false, 'W') => (3, 7 * 86_400 * SEC),
            (false, 'D') => (4, 86_400 * SEC),
            (true, 'H') => (5, 3600 * SEC),
            (true, 'M') => (6, 60 * SEC),
            (true, 'S') => (7, SEC),
            _ => return Err(bad()),
        };
        if rank <= last_rank {
            return Err(bad());
        }
        last_rank = rank;
        components += 1;
        let (int, frac) = match number.split_once(['.', ',']) {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if int.is_empty() || frac.contains(['.', ',']) || frac.len() > 9 {
            return Err(bad());
        }
        let int: u128 = int.parse().map_err(|_| bad())?;
        let mut nanos = int.checked_mul(unit_nanos).ok_or_else(bad)?;
        if !frac.is_empty() {
            let digits = u32::try_from(frac.len()).map_err(|_| bad())?;
            let f: u128 = frac.parse().map_err(|_| bad())?;
            nanos += f * unit_nanos / 10u128.pow(digits);
        }
        total = total.checked_add(nanos).ok_or_else(bad)?;
    }
    if components == 0 {
        return Err(bad());
    }
    let secs = u64::try_from(total / SEC).map_err(|_| bad())?;
    let nanos = u32::try_from(total % SEC).map_err(|_| bad())?;
    Ok(Duration::new(secs, nanos))
}

/// Formats a duration in ISO-8601 (`PT1M`, `P7D`, `PT0.5S`).
pub fn format_duration(d: Duration) -> String {
    let mut out = String::from("P");
    let mut secs = d.as_secs();
    let days = secs / 86_400;
    secs %= 86_400;
    if days > 0 {
        let _ = write!(out, "{days}D");
    }
    let nanos = d.subsec_nanos();
    if secs > 0 || nanos > 0 || days == 0 {
        out.push('T');
        let (h, m, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
        if h > 0 {
            let _ = write!(out, "{h}H");
        }
        if m > 0 {
            let _ = write!(out, "{m}M");
        }
        if nanos > 0 {
            let frac = format!("{nanos:09}");
            let _ = write!(out, "{s}.{}S", frac.trim_end_matches('0'));
        } else if s > 0 || (h == 0 && m == 0) {
            let _ = write!(out, "{s}S");
        }
    }
    out
}

/// A parsed emulator `Config.json`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// The namespaces (the emulator allows exactly one; any number is accepted here, and their
    /// entities share one broker).
    pub namespaces: Vec<NamespaceConfig>,
    /// `Logging.Type`, kept but not used by the broker.
    pub logging: Option<String>,
}

/// One namespace of a [`Config`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct NamespaceConfig {
    /// Its name (not checked).
    pub name: String,
    /// Its queues.
    pub queues: Vec<(String, QueueProperties)>,
    /// Its topics.
    pub topics: Vec<TopicConfig>,
}

/// One topic of a [`NamespaceConfig`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TopicConfig {
    /// The topic name.
    pub name: String,
    /// Its properties.
    pub properties: TopicProperties,
    /// Its subscriptions: name, properties and rules (empty: the `$Default` rule).
    pub subscriptions: Vec<(String, SubscriptionProperties, Vec<Rule>)>,
}

impl Config {
    /// Reads and parses a `Config.json` file.
    pub fn from_path(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::ConfigIo { path: path.to_owned(), source })?;
        Self::from_json(&text)
    }

    /// Parses the text of a `Config.json` file. `//` and `/* */` comments are allowed, as the
    /// emulator's own sample has them.
    pub fn from_json(text: &str) -> Result<Self, Error> {
        let stripped = strip_comments(text);
        let root: Json = serde_json::from_str(&stripped)
            .map_err(|e| Error::Config { path: "$".to_owned(), message: e.to_string() })?;
        parse_root(&root)
    }

    /// The entity definitions to create, topics before their subscriptions.
    ///
    /// Fails on what the broker cannot apply: a SQL filter (not supported yet), an entity
    /// declared twice, or a `ForwardTo` naming an entity the file does not declare. Each
    /// error names the JSON path.
    pub fn entities(&self) -> Result<Vec<EntityDefinition>, Error> {
        let mut out = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for (n, ns) in self.namespaces.iter().enumerate() {
            let ns_path = format!("UserConfig.Namespaces[{n}]");
            for (q, (name, props)) in ns.queues.iter().enumerate() {
                let path = format!("{ns_path}.Queues[{q}].Name");
                claim_name(&mut names, name, &path)?;
                out.push(EntityDefinition::queue(name.clone(), props.clone()));
            }
            for (t, topic) in ns.topics.iter().enumerate() {
                let path = format!("{ns_path}.Topics[{t}]");
                claim_name(&mut names, &topic.name, &format!("{path}.Name"))?;
                out.push(EntityDefinition::topic(topic.name.clone(), topic.properties.clone()));
                let mut sub_names: Vec<String> = Vec::new();
                for (s, (name, props, rules)) in topic.subscriptions.iter().enumerate() {
                    let sub_path = format!("{path}.Subscriptions[{s}]");
                    claim_name(&mut sub_names, name, &format!("{sub_path}.Name"))?;
                    for (r, rule) in rules.iter().enumerate() {
                        if matches!(rule.filter, Filter::Sql(_)) {
                            return Err(Error::Config {
                                path: format!("{sub_path}.Rules[{r}]"),
                                message: format!(
                                    "rule {:?}: SQL filters are not supported yet (use a \
                                     Correlation filter)",
                                    rule.name
                                ),
                            });
                        }
                    }
                    out.push(EntityDefinition::subscription(
                        topic.name.clone(),
                        name.clone(),
                        props.clone(),
                        rules.clone(),
                    ));
                }
            }
        }
        // Forwarding targets must be declared in the same file.
        for (n, ns) in self.namespaces.iter().enumerate() {
            let ns_path = format!("UserConfig.Namespaces[{n}]");
            for (q, (_, props)) in ns.queues.iter().enumerate() {
                let path = format!("{ns_path}.Queues[{q}].Properties");
                check_target(&names, props.forward_to.as_deref(), &path, "ForwardTo")?;
                check_target(
                    &names,
                    props.forward_dead_lettered_messages_to.as_deref(),
                    &path,
                    "ForwardDeadLetteredMessagesTo",
                )?;
            }
            for (t, topic) in ns.topics.iter().enumerate() {
                for (s, (_, props, _)) in topic.subscriptions.iter().enumerate() {
                    let path = format!("{ns_path}.Topics[{t}].Subscriptions[{s}].Properties");
                    check_target(&names, props.forward_to.as_deref(), &path, "ForwardTo")?;
                    check_target(
                        &names,
                        props.forward_dead_lettered_messages_to.as_deref(),
                        &path,
                        "ForwardDeadLetteredMessagesTo",
                    )?;
                }
            }
        }
        Ok(out)
    }
}

fn claim_name(names: &mut Vec<String>, name: &str, path: &str) -> Result<(), Error> {
    let key = name.to_ascii_lowercase();
    if names.contains(&key) {
        return Err(Error::Config {
            path: path.to_owned(),
            message: format!("{name:?} is declared twice (names are case-insensitive)"),
        });
    }
    names.push(key);
    Ok(())
}

fn check_target(
    names: &[String],
    to: Option<&str>,
    path: &str,
    property: &str,
) -> Result<(), Error> {
    match to {
        Some(to) if !names.contains(&to.to_ascii_lowercase()) => Err(Error::Config {
            path: format!("{path}.{property}"),
            message: format!("{to:?} is not a queue or topic declared in this file"),
        }),
        _ => Ok(()),
    }
}

/// Removes `//` and `/* */` comments outside strings, keeping line breaks so that serde_json's
/// line numbers still point at the right line.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            if c == '\\' {
                if let Some(escaped) = chars.next() {
                    out.push(escaped);
                }
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match (c, chars.peek()) {
            ('"', _) => {
                in_string = true;
                out.push(c);
            }
            ('/', Some('/')) => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('/', Some('*')) => {
                chars.next();
                let mut prev = '\0';
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                    }
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

fn config_err(path: &str, message: impl Into<String>) -> Error {
    Error::Config { path: path.to_owned(), message: message.into() }
}

fn json_type(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// An object whose keys are checked against the allowed ones.
struct Obj<'a> {
    map: &'a Map<String, Json>,
    path: String,
}

impl<'a> Obj<'a> {
    fn new(v: &'a Json, path: &str, allowed: &[&str]) -> Result<Self, Error> {
        let map = v.as_object().ok_or_else(|| {
            config_err(path, format!("expected an object, found {}", json_type(v)))
        })?;
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                return Err(config_err(
                    &format!("{path}.{key}"),
                    format!("unknown property {key:?} (expected one of: {})", allowed.join(", ")),
                ));
            }
        }
        Ok(Self { map, path: path.to_owned() })
    }

    fn at(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    fn get(&self, key: &str) -> Option<&'a Json> {
        self.map.get(key)
    }

    fn required(&self, key: &str) -> Result<&'a Json, Error> {
        self.get(key).ok_or_else(|| config_err(&self.at(key), "required property is missing"))
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::String(s)) => Ok(Some(s)),
            Some(v) => {
                Err(config_err(&self.at(key), format!("expected a string, found {}", json_type(v))))
            }
        }
    }

    fn required_string(&self, key: &str) -> Result<&'a str, Error> {
        self.required(key)?;
        self.string(key).map(|s| s.unwrap_or_default())
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(config_err(
                &self.at(key),
                format!("expected a boolean, found {}", json_type(v)),
            )),
        }
    }

    fn duration(&self, key: &str) -> Result<Option<Duration>, Error> {
        match self.string(key)? {
            None => Ok(None),
            Some(s) => parse_duration(s).map(Some).map_err(|m| config_err(&self.at(key), m)),
        }
    }

    fn u32(&self, key: &str) -> Result<Option<u32>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Number(n)) => {
                n.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| {
                    config_err(&self.at(key), format!("expected a whole number, found {n}"))
                })
            }
            Some(v) => {
                Err(config_err(&self.at(key), format!("expected a number, found {}", json_type(v))))
            }
        }
    }

    fn array(&self, key: &str) -> Result<&'a [Json], Error> {
        match self.get(key) {
            None => Ok(&[]),
            Some(Json::Array(a)) => Ok(a),
            Some(v) => {
                Err(config_err(&self.at(key), format!("expected an array, found {}", json_type(v))))
            }
        }
    }

    /// An optional `ForwardTo`-style name, where the empty string means none.
    fn forward(&self, key: &str) -> Result<Option<String>, Error> {
        match self.string(key)? {
            None | Some("") => Ok(None),
            Some(s) => {
                validate_entity_name(s).map_err(|e| config_err(&self.at(key), e.to_string()))?;
                Ok(Some(s.to_owned()))
            }
        }
    }
}

/// Maps a property error from `validate` onto the JSON path of the property.
fn property_err(props_path: &str, e: Error) -> Error {
    match e {
        Error::InvalidProperty { property, reason } => {
            config_err(&format!("{props_path}.{property}"), reason)
        }
        other => config_err(props_path, other.to_string()),
    }
}

fn parse_root(root: &Json) -> Result<Config, Error> {
    let top = Obj::new(root, "$", &["UserConfig"])?;
    let user = Obj::new(top.required("UserConfig")?, "UserConfig", &["Namespaces", "Logging"])?;
    let logging = match user.get("Logging") {
        None => None,
        Some(v) => {
            let l = Obj::new(v, "UserConfig.Logging", &["Type"])?;
            l.string("Type")?.map(str::to_owned)
        }
    };
    let mut namespaces = Vec::new();
    user.required("Namespaces")?;
    for (n, ns) in user.array("Namespaces")?.iter().enumerate() {
        let path = format!("UserConfig.Namespaces[{n}]");
        let ns = Obj::new(ns, &path, &["Name", "Queues", "Topics"])?;
        let name = ns.required_string("Name")?.to_owned();
        let mut queues = Vec::new();
        for (q, queue) in ns.array("Queues")?.iter().enumerate() {
            queues.push(parse_queue(queue, &format!("{path}.Queues[{q}]"))?);
        }
        let mut topics = Vec::new();
        for (t, topic) in ns.array("Topics")?.iter().enumerate() {
            topics.push(parse_topic(topic, &format!("{path}.Topics[{t}]"))?);
        }
        namespaces.push(NamespaceConfig { name, queues, topics });
    }
    Ok(Config { namespaces, logging })
}

fn entity_name(o: &Obj<'_>, subscription: bool) -> Result<String, Error> {
    let name = o.required_string("Name")?;
    let checked =
        if subscription { validate_subscription_name(name) } else { validate_entity_name(name) };
    checked.map_err(|e| config_err(&o.at("Name"), e.to_string()))?;
    Ok(name.to_owned())
}

fn parse_queue(v: &Json, path: &str) -> Result<(String, QueueProperties), Error> {
    let o = Obj::new(v, path, &["Name", "Properties"])?;
    let name = entity_name(&o, false)?;
    let mut props = QueueProperties::default();
    if let Some(p) = o.get("Properties") {
        let pp = o.at("Properties");
        let p = Obj::new(
            p,
            &pp,
            &[
                "DeadLetteringOnMessageExpiration",
                "DefaultMessageTimeToLive",
                "DuplicateDetectionHistoryTimeWindow",
                "ForwardDeadLetteredMessagesTo",
                "ForwardTo",
                "LockDuration",
                "MaxDeliveryCount",
                "RequiresDuplicateDetection",
                "RequiresSession",
            ],
        )?;
        if let Some(b) = p.bool("DeadLetteringOnMessageExpiration")? {
            props.dead_lettering_on_message_expiration = b;
        }
        if let Some(d) = p.duration("DefaultMessageTimeToLive")? {
            props.default_message_time_to_live = Some(d);
        }
        if let Some(d) = p.duration("DuplicateDetectionHistoryTimeWindow")? {
            props.duplicate_detection_history_time_window = d;
        }
        props.forward_dead_lettered_messages_to = p.forward("ForwardDeadLetteredMessagesTo")?;
        props.forward_to = p.forward("ForwardTo")?;
        if let Some(d) = p.duration("LockDuration")? {
            props.lock_duration = d;
        }
        if let Some(n) = p.u32("MaxDeliveryCount")? {
            props.max_delivery_count = n;
        }
        if let Some(b) = p.bool("RequiresDuplicateDetection")? {
            props.requires_duplicate_detection = b;
        }
        if let Some(b) = p.bool("RequiresSession")? {
            props.requires_session = b;
        }
        props.validate().map_err(|e| property_err(&pp, e))?;
    }
    Ok((name, props))
}

fn parse_topic(v: &Json, path: &str) -> Result<TopicConfig, Error> {
    let o = Obj::new(v, path, &["Name", "Properties", "Subscriptions"])?;
    let name = entity_name(&o, false)?;
    let mut properties = TopicProperties::default();
    if let Some(p) = o.get("Properties") {
        let pp = o.at("Properties");
        let p = Obj::new(
            p,
            &pp,
            &[
                "DefaultMessageTimeToLive",
                "DuplicateDetectionHistoryTimeWindow",
                "RequiresDuplicateDetection",
            ],
        )?;
        if let Some(d) = p.duration("DefaultMessageTimeToLive")? {
            properties.default_message_time_to_live = Some(d);
        }
        if let Some(d) = p.duration("DuplicateDetectionHistoryTimeWindow")? {
            properties.duplicate_detection_history_time_window = d;
        }
        if let Some(b) = p.bool("RequiresDuplicateDetection")? {
            properties.requires_duplicate_detection = b;
        }
        properties.validate().map_err(|e| property_err(&pp, e))?;
    }
    let mut subscriptions = Vec::new();
    for (s, sub) in o.array("Subscriptions")?.iter().enumerate() {
        subscriptions.push(parse_subscription(sub, &format!("{path}.Subscriptions[{s}]"))?);
    }
    Ok(TopicConfig { name, properties, subscriptions })
}

fn parse_subscription(
    v: &Json,
    path: &str,
) -> Result<(String, SubscriptionProperties, Vec<Rule>), Error> {
    let o = Obj::new(v, path, &["Name", "Properties", "Rules"])?;
    let name = entity_name(&o, true)?;
    let mut props = SubscriptionProperties::default();
    if let Some(p) = o.get("Properties") {
        let pp = o.at("Properties");
        let p = Obj::new(
            p,
            &pp,
            &[
                "DeadLetteringOnMessageExpiration",
                "DefaultMessageTimeToLive",
                "ForwardDeadLetteredMessagesTo",
                "ForwardTo",
                "LockDuration",
                "MaxDeliveryCount",
                "RequiresSession",
            ],
        )?;
        if let Some(b) = p.bool("DeadLetteringOnMessageExpiration")? {
            props.dead_lettering_on_message_expiration = b;
        }
        if let Some(d) = p.duration("DefaultMessageTimeToLive")? {
            props.default_message_time_to_live = Some(d);
        }
        props.forward_dead_lettered_messages_to = p.forward("ForwardDeadLetteredMessagesTo")?;
        props.forward_to = p.forward("ForwardTo")?;
        if let Some(d) = p.duration("LockDuration")? {
            props.lock_duration = d;
        }
        if let Some(n) = p.u32("MaxDeliveryCount")? {
            props.max_delivery_count = n;
        }
        if let Some(b) = p.bool("RequiresSession")? {
            props.requires_session = b;
        }
        props.validate().map_err(|e| property_err(&pp, e))?;
    }
    let mut rules: Vec<Rule> = Vec::new();
    for (r, rule) in o.array("Rules")?.iter().enumerate() {
        let rule_path = format!("{path}.Rules[{r}]");
        let rule = parse_rule(rule, &rule_path)?;
        if rules.iter().any(|x| x.name.eq_ignore_ascii_case(&rule.name)) {
            return Err(config_err(
                &format!("{rule_path}.Name"),
                format!("rule {:?} is declared twice", rule.name),
            ));
        }
        rules.push(rule);
    }
    Ok((name, props, rules))
}

fn parse_rule(v: &Json, path: &str) -> Result<Rule, Error> {
    let o = Obj::new(v, path, &["Name", "Properties"])?;
    let name = entity_name(&o, true)?;
    let pp = o.at("Properties");
    let p = Obj::new(
        o.required("Properties")?,
        &pp,
        &["FilterType", "CorrelationFilter", "SqlFilter", "Action"],
    )?;
    let filter = match p.required_string("FilterType")? {
        "Correlation" => {
            let cp = p.at("CorrelationFilter");
            let c = Obj::new(
                p.required("CorrelationFilter")?,
                &cp,
                &[
                    "ContentType",
                    "CorrelationId",
                    "Label",
                    "MessageId",
                    "ReplyTo",
                    "ReplyToSessionId",
                    "SessionId",
                    "To",
                    "Properties",
                ],
            )?;
            // An empty string is how the emulator's files leave a field unset.
            let field = |key: &str| -> Result<Option<String>, Error> {
                Ok(c.string(key)?.filter(|s| !s.is_empty()).map(str::to_owned))
            };
            let mut filter = CorrelationFilter {
                message_id: field("MessageId")?,
                correlation_id: field("CorrelationId")?,
                session_id: field("SessionId")?,
                subject: field("Label")?,
                to: field("To")?,
                reply_to: field("ReplyTo")?,
                reply_to_session_id: field("ReplyToSessionId")?,
                content_type: field("ContentType")?,
                properties: Properties::new(),
            };
            if let Some(props) = c.get("Properties") {
                let props_path = c.at("Properties");
                let map = props.as_object().ok_or_else(|| {
                    config_err(
                        &props_path,
                        format!("expected an object, found {}", json_type(props)),
                    )
                })?;
                for (k, v) in map {
                    let value = match v {
                        Json::String(s) => Value::String(s.clone()),
                        Json::Bool(b) => Value::Bool(*b),
                        Json::Number(n) => match (n.as_i64(), n.as_f64()) {
                            (Some(i), _) => Value::Long(i),
                            (None, Some(x)) => Value::Double(x),
                            (None, None) => {
                                return Err(config_err(
                                    &format!("{props_path}.{k}"),
                                    "number out of range",
                                ));
                            }
                        },
                        other => {
                            return Err(config_err(
                                &format!("{props_path}.{k}"),
                                format!(
                                    "expected a string, number or boolean, found {}",
                                    json_type(other)
                                ),
                            ));
                        }
                    };
                    filter.properties.insert(k.clone(), value);
                }
            }
            Filter::Correlation(filter)
        }
        "Sql" => {
            let sp = p.at("SqlFilter");
            let s = Obj::new(p.required("SqlFilter")?, &sp, &["SqlExpression"])?;
            if let Some(action) = p.get("Action") {
                let a = Obj::new(action, &p.at("Action"), &["SqlExpression"])?;
                a.required_string("SqlExpression")?;
            }
            Filter::Sql(s.required_string("SqlExpression")?.to_owned())
        }
        other => {
            return Err(config_err(
                &p.at("FilterType"),
                format!("unknown filter type {other:?} (expected \"Correlation\" or \"Sql\")"),
            ));
        }
    };
    Ok(Rule { name, filter })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulator's own sample, `ServiceBus-Emulator/Config/Config.json`, comments included.
    const SAMPLE: &str = r#"{
  "UserConfig": {
    "Namespaces": [
      {
        "Name": "sbemulatorns",
        "Queues": [
          {
            "Name": "queue.1",
            "Properties": {
              "DeadLetteringOnMessageExpiration": false,
              "DefaultMessageTimeToLive": "PT1H",
              "DuplicateDetectionHistoryTimeWindow": "PT20S",
              "ForwardDeadLetteredMessagesTo": "",
              "ForwardTo": "",
              "LockDuration": "PT1M",
              "MaxDeliveryCount": 3,
              "RequiresDuplicateDetection": false,
              "RequiresSession": false
            }
          }
        ],

        "Topics": [
          {
            "Name": "topic.1",
            "Properties": {
              "DefaultMessageTimeToLive": "PT1H",
              "DuplicateDetectionHistoryTimeWindow": "PT20S",
              "RequiresDuplicateDetection": false
            },
            "Subscriptions": [
              {
                "Name": "subscription.1",
                "Properties": {
                  "DeadLetteringOnMessageExpiration": false,
                  "DefaultMessageTimeToLive": "PT1H",
                  "LockDuration": "PT1M",
                  "MaxDeliveryCount": 3,
                  "ForwardDeadLetteredMessagesTo": "",
                  "ForwardTo": "",
                  "RequiresSession": false
                },
                "Rules": [
                  {
                    "Name": "app-prop-filter-1",
                    "Properties": {
                      "FilterType": "Correlation",
                      "CorrelationFilter": {
                        "ContentType": "application/json"
                        // Other supported properties
                        // "CorrelationId": "id1",
                        // "Label": "subject1",
                        // "MessageId": "msgid1",
                        // "ReplyTo": "someQueue",
                        // "ReplyToSessionId": "sessionId",
                        // "SessionId": "session1",
                        // "To": "xyz"
                      }
                    }
                  }
                ]
              },
              {
                "Name": "subscription.2",
                "Properties": {
                  "DeadLetteringOnMessageExpiration": false,
                  "DefaultMessageTimeToLive": "PT1H",
                  "LockDuration": "PT1M",
                  "MaxDeliveryCount": 3,
                  "ForwardDeadLetteredMessagesTo": "",
                  "ForwardTo": "",
                  "RequiresSession": false
                },
                "Rules": [
                  {
                    "Name": "user-prop-filter-1",
                    "Properties": {
                      "FilterType": "Correlation",
                      "CorrelationFilter": {
                        "Properties": {
                          "prop1": "value1"
                        }
                      }
                    }
                  }
                ]
              },
              {
                "Name": "subscription.3",
                "Properties": {
                  "DeadLetteringOnMessageExpiration": false,
                  "DefaultMessageTimeToLive": "PT1H",
                  "LockDuration": "PT1M",
                  "MaxDeliveryCount": 3,
                  "ForwardDeadLetteredMessagesTo": "",
                  "ForwardTo": "",
                  "RequiresSession": false
                }
              },
              {
                "Name": "subscription.4",
                "Properties": {
                  "DeadLetteringOnMessageExpiration": false,
                  "DefaultMessageTimeToLive": "PT1H",
                  "LockDuration": "PT1M",
                  "MaxDeliveryCount": 3,
                  "ForwardDeadLetteredMessagesTo": "",
                  "ForwardTo": "",
                  "RequiresSession": false
                },
                "Rules": [
                  {
                    "Name": "sql-filter-1",
                    "Properties": {
                      "FilterType": "Sql",
                      "SqlFilter": {
                        "SqlExpression": "sys.MessageId = '123456' AND userProp1 = 'value1'"
                      },
                      "Action" : {
                        "SqlExpression": "SET sys.To = 'Entity'"
                      }
                    }
                  }
                ]
              }
            ]
          }
        ]
      }
    ],
    "Logging": {
      "Type": "File"
    }
  }
}"#;

    #[test]
    fn the_emulator_sample_parses() {
        let config = Config::from_json(SAMPLE).unwrap();
        assert_eq!(config.logging.as_deref(), Some("File"));
        let ns = &config.namespaces[0];
        assert_eq!(ns.name, "sbemulatorns");
        let (name, q) = &ns.queues[0];
        assert_eq!(name, "queue.1");
        assert_eq!(q.max_delivery_count, 3);
        assert_eq!(q.lock_duration, Duration::from_secs(60));
        assert_eq!(q.default_message_time_to_live, Some(Duration::from_secs(3600)));
        assert_eq!(q.duplicate_detection_history_time_window, Duration::from_secs(20));
        assert_eq!(
            (q.forward_to.as_deref(), q.forward_dead_lettered_messages_to.as_deref()),
            (None, None)
        );
        let t = &ns.topics[0];
        assert_eq!(t.subscriptions.len(), 4);
        let (_, _, rules) = &t.subscriptions[0];
        let Filter::Correlation(c) = &rules[0].filter else { panic!("{rules:?}") };
        assert_eq!(c.content_type.as_deref(), Some("application/json"));
        let (_, _, rules) = &t.subscriptions[1];
        let Filter::Correlation(c) = &rules[0].filter else { panic!("{rules:?}") };
        assert_eq!(c.properties.get("prop1"), Some(&Value::String("value1".to_owned())));
        assert!(t.subscriptions[2].2.is_empty());
        assert!(
            matches!(&t.subscriptions[3].2[0].filter, Filter::Sql(s) if s.starts_with("sys.MessageId"))
        );
    }

    #[test]
    fn the_sample_sql_rule_is_rejected_with_its_path() {
        let err = Config::from_json(SAMPLE).unwrap().entities().unwrap_err();
        assert_eq!(
            err.to_string(),
            "UserConfig.Namespaces[0].Topics[0].Subscriptions[3].Rules[0]: rule \"sql-filter-1\": SQL \
             filters are not supported yet (use a Correlation filter)"
        );
    }

    #[test]
    fn the_sample_without_its_sql_rule_gives_entities() {
        let mut config = Config::from_json(SAMPLE).unwrap();
        config.namespaces[0].topics[0].subscriptions.pop();
        let entities = config.entities().unwrap();
        let paths: Vec<String> = entities.iter().map(EntityDefinition::path).collect();
        assert_eq!(
            paths,
            [
                "queue.1",
                "topic.1",
                "topic.1/Subscriptions/subscription.1",
                "topic.1/Subscriptions/subscription.2",
                "topic.1/Subscriptions/subscription.3"
            ]
        );
        for e in &entities {
            e.validate().unwrap();
        }
    }

    /// A config with one queue whose properties are `props` (a JSON object body).
    fn queue(props: &str) -> String {
        format!(
            r#"{{"UserConfig":{{"Namespaces":[{{"Name":"n","Queues":[{{"Name":"q","Properties":{{{props}}}}}],"Topics":[]}}]}}}}"#
        )
    }

    fn sub(props: &str, rules: &str) -> String {
        format!(
            r#"{{"UserConfig":{{"Namespaces":[{{"Name":"n","Queues":[],"Topics":[{{"Name":"t","Subscriptions":[{{"Name":"s","Properties":{{{props}}},"Rules":[{rules}]}}]}}]}}]}}}}"#
        )
    }

    #[track_caller]
    fn check_err(json: &str, expect: &str) {
        let got = match Config::from_json(json).and_then(|c| c.entities()) {
            Ok(e) => format!("ok: {e:?}"),
            Err(e) => e.to_string(),
        };
        assert_eq!(got, expect, "for {json}");
    }

    #[test]
    fn each_wrong_property_names_its_path() {
        let q = "UserConfig.Namespaces[0].Queues[0].Properties";
        check_err(
            &queue(r#""LockDuration":"PT4S""#),
            &format!("{q}.LockDuration: PT4S is outside PT5S..=PT5M"),
        );
        check_err(
            &queue(r#""LockDuration":"PT6M""#),
            &format!("{q}.LockDuration: PT6M is outside PT5S..=PT5M"),
        );
        check_err(
            &queue(r#""LockDuration":60"#),
            &format!("{q}.LockDuration: expected a string, found a number"),
        );
        check_err(
            &queue(r#""LockDuration":"1 minute""#),
            &format!(
                "{q}.LockDuration: \"1 minute\" is not an ISO-8601 duration such as PT1M, PT30S or P7D"
            ),
        );
        check_err(
            &queue(r#""MaxDeliveryCount":0"#),
            &format!("{q}.MaxDeliveryCount: must be at least 1"),
        );
        check_err(
            &queue(r#""MaxDeliveryCount":-1"#),
            &format!("{q}.MaxDeliveryCount: expected a whole number, found -1"),
        );
        check_err(
            &queue(r#""MaxDeliveryCount":3.5"#),
            &format!("{q}.MaxDeliveryCount: expected a whole number, found 3.5"),
        );
        check_err(
            &queue(r#""MaxDeliveryCount":"3""#),
            &format!("{q}.MaxDeliveryCount: expected a number, found a string"),
        );
        check_err(
            &queue(r#""RequiresSession":"yes""#),
            &format!("{q}.RequiresSession: expected a boolean, found a string"),
        );
        check_err(
            &queue(r#""RequiresSession":null"#),
            &format!("{q}.RequiresSession: expected a boolean, found null"),
        );
        check_err(
            &queue(r#""DuplicateDetectionHistoryTimeWindow":"PT10S""#),
            &format!("{q}.DuplicateDetectionHistoryTimeWindow: PT10S is outside PT20S..=P7D"),
        );
        check_err(
            &queue(r#""DefaultMessageTimeToLive":"PT0S""#),
            &format!("{q}.DefaultMessageTimeToLive: PT0S is shorter than the minimum PT1S"),
        );
        check_err(
            &queue(r#""ForwardTo":"bad name""#),
            &format!(
                "{q}.ForwardTo: invalid entity name \"bad name\": a queue or topic name has only letters, digits, '.', '-', '_' and '/'"
            ),
        );
        check_err(
            &queue(r#""ForwardTo":"missing""#),
            &format!("{q}.ForwardTo: \"missing\" is not a queue or topic declared in this file"),
        );
        check_err(
            &queue(r#""Lockduration":"PT1M""#),
            &format!(
                "{q}.Lockduration: unknown property \"Lockduration\" (expected one of: DeadLetteringOnMessageExpiration, \
                 DefaultMessageTimeToLive, DuplicateDetectionHistoryTimeWindow, ForwardDeadLetteredMessagesTo, ForwardTo, \
                 LockDuration, MaxDeliveryCount, RequiresDuplicateDetection, RequiresSession)"
            ),
        );
    }

    #[test]
    fn topic_subscription_and_rule_errors_name_their_path() {
        let t = r#"{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[],"Topics":[{"Name":"t","Properties":{"LockDuration":"PT1M"},"Subscriptions":[]}]}]}}"#;
        check_err(
            t,
            "UserConfig.Namespaces[0].Topics[0].Properties.LockDuration: unknown property \"LockDuration\" (expected one \
             of: DefaultMessageTimeToLive, DuplicateDetectionHistoryTimeWindow, RequiresDuplicateDetection)",
        );
        let s = "UserConfig.Namespaces[0].Topics[0].Subscriptions[0]";
        check_err(
            &sub(r#""MaxDeliveryCount":0"#, ""),
            &format!("{s}.Properties.MaxDeliveryCount: must be at least 1"),
        );
        check_err(
            &sub("", r#"{"Name":"r","Properties":{"FilterType":"Bogus"}}"#),
            &format!(
                "{s}.Rules[0].Properties.FilterType: unknown filter type \"Bogus\" (expected \"Correlation\" or \"Sql\")"
            ),
        );
        check_err(
            &sub("", r#"{"Name":"r"}"#),
            &format!("{s}.Rules[0].Properties: required property is missing"),
        );
        check_err(
            &sub(
                "",
                r#"{"Name":"r","Properties":{"FilterType":"Correlation","CorrelationFilter":{"Subject":"x"}}}"#,
            ),
            &format!(
                "{s}.Rules[0].Properties.CorrelationFilter.Subject: unknown property \"Subject\" (expected one of: ContentType, \
                 CorrelationId, Label, MessageId, ReplyTo, ReplyToSessionId, SessionId, To, Properties)"
            ),
        );
        check_err(
            &sub(
                "",
                r#"{"Name":"r","Properties":{"FilterType":"Correlation","CorrelationFilter":{"Properties":{"k":[1]}}}}"#,
            ),
            &format!(
                "{s}.Rules[0].Properties.CorrelationFilter.Properties.k: expected a string, number or boolean, found an array"
            ),
        );
        check_err(
            &sub(
                "",
                r#"{"Name":"r","Properties":{"FilterType":"Sql","SqlFilter":{"SqlExpression":"1=1"}}}"#,
            ),
            &format!(
                "{s}.Rules[0]: rule \"r\": SQL filters are not supported yet (use a Correlation filter)"
            ),
        );
        check_err(
            &sub(
                "",
                r#"{"Name":"r","Properties":{"FilterType":"Correlation","CorrelationFilter":{"Label":"a"}}},{"Name":"R","Properties":{"FilterType":"Correlation","CorrelationFilter":{"Label":"b"}}}"#,
            ),
            &format!("{s}.Rules[1].Name: rule \"R\" is declared twice"),
        );
    }

    #[test]
    fn structure_errors_name_their_path() {
        check_err("{", "$: EOF while parsing an object at line 1 column 1");
        check_err(r#"{"UserConfig":{}}"#, "UserConfig.Namespaces: required property is missing");
        check_err(
            r#"{"UserConfig":{"Namespaces":{}}}"#,
            "UserConfig.Namespaces: expected an array, found an object",
        );
        check_err(
            r#"{"UserConfig":{"Namespaces":[]},"Extra":1}"#,
            "$.Extra: unknown property \"Extra\" (expected one of: UserConfig)",
        );
        check_err(
            r#"{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[{"Properties":{}}]}]}}"#,
            "UserConfig.Namespaces[0].Queues[0].Name: required property is missing",
        );
        check_err(
            r#"{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[{"Name":"-q"}]}]}}"#,
            "UserConfig.Namespaces[0].Queues[0].Name: invalid entity name \"-q\": a name starts and ends with a letter or digit",
        );
        check_err(
            r#"{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[{"Name":"q"}],"Topics":[{"Name":"Q","Subscriptions":[]}]}]}}"#,
            "UserConfig.Namespaces[0].Topics[0].Name: \"Q\" is declared twice (names are case-insensitive)",
        );
        check_err(
            r#"{"UserConfig":{"Namespaces":[{"Name":"anything","Queues":[{"Name":"q"}]}],"Logging":{"Type":"Console"}}}"#,
            &format!("ok: {:?}", [EntityDefinition::queue("q", QueueProperties::default())]),
        );
    }

    #[test]
    fn iso_8601_durations() {
        let ok = [
            ("PT1M", Duration::from_secs(60)),
            ("P7D", Duration::from_secs(7 * 86_400)),
            ("PT10M30S", Duration::from_secs(630)),
            ("PT0.5S", Duration::from_millis(500)),
            ("PT0,25S", Duration::from_millis(250)),
            ("P1DT2H", Duration::from_secs(26 * 3600)),
            ("PT1.5M", Duration::from_secs(90)),
            ("P1W", Duration::from_secs(7 * 86_400)),
            ("P1M", Duration::from_secs(30 * 86_400)),
            ("P1Y", Duration::from_secs(365 * 86_400)),
            ("PT0S", Duration::ZERO),
        ];
        for (s, d) in ok {
            assert_eq!(parse_duration(s), Ok(d), "{s}");
        }
        for bad in [
            "", "P", "PT", "1M", "PT1X", "P1S", "PT1S1M", "PT-1S", "P1DT", "PT.5S", "PT1.2.3S",
            "pt1m",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn durations_format_back() {
        for (d, s) in [
            (Duration::from_secs(60), "PT1M"),
            (Duration::from_secs(7 * 86_400), "P7D"),
            (Duration::from_secs(630), "PT10M30S"),
            (Duration::from_millis(500), "PT0.5S"),
            (Duration::from_secs(90_061), "P1DT1H1M1S"),
            (Duration::ZERO, "PT0S"),
        ] {
            assert_eq!(format_duration(d), s);
            assert_eq!(parse_duration(s), Ok(d));
        }
    }

    #[test]
    fn correlation_properties_compare_by_value() {
        let mut f = CorrelationFilter::default();
        f.properties.insert("n".to_owned(), Value::Long(1));
        let m = |v: Value| Message::new("x").with_property("n", v);
        assert!(f.matches(&m(Value::Int(1))));
        assert!(f.matches(&m(Value::Ubyte(1))));
        assert!(f.matches(&m(Value::Double(1.0))));
        assert!(!f.matches(&m(Value::Long(2))));
        assert!(!f.matches(&m(Value::String("1".to_owned()))));
        assert!(!f.matches(&Message::new("x")));
        f.properties.insert("n".to_owned(), Value::String("a".to_owned()));
        assert!(f.matches(&m(Value::Symbol("a".to_owned()))));
    }

    #[test]
    fn from_path_reads_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("Config.json");
        std::fs::write(&path, SAMPLE).unwrap();
        assert_eq!(Config::from_path(&path).unwrap(), Config::from_json(SAMPLE).unwrap());
        let missing = dir.path().join("missing.json");
        assert!(
            matches!(Config::from_path(&missing), Err(Error::ConfigIo { path, .. }) if path == missing)
        );
    }
}
