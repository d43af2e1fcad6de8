//! The entity model: properties with their Service Bus names, defaults and ranges, rules and
//! filters, and entity definitions.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use twice::{Message, Properties, Value};

use crate::error::Error;
use crate::sql::{SqlAction, SqlFilter};
use twice::iso_duration::format_duration;

/// The shortest lock a queue or subscription may have.
pub const MIN_LOCK_DURATION: Duration = Duration::from_secs(5);
/// The longest lock a queue or subscription may have.
pub const MAX_LOCK_DURATION: Duration = Duration::from_secs(5 * 60);
/// The shortest duplicate-detection window: 5 seconds, as the Service Bus emulator accepts
/// (Service Bus itself asks for 20).
pub const MIN_DUPLICATE_DETECTION_WINDOW: Duration = Duration::from_secs(5);
/// The longest duplicate-detection window.
pub const MAX_DUPLICATE_DETECTION_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// The shortest default time to live of an entity.
pub const MIN_DEFAULT_TIME_TO_LIVE: Duration = Duration::from_secs(1);
/// The default `MaxSizeInMegabytes` of a queue or topic: 1 GiB, as Service Bus.
pub const DEFAULT_MAX_SIZE_IN_MEGABYTES: u64 = 1024;
/// The largest `MaxSizeInMegabytes`: 80 GiB, the largest Service Bus offers.
pub const MAX_MAX_SIZE_IN_MEGABYTES: u64 = 80 * 1024;
/// The longest queue or topic name (a subscription's or rule's name has its own limit).
pub const MAX_ENTITY_NAME_LEN: usize = 260;
/// The longest subscription or rule name.
pub const MAX_SUBSCRIPTION_NAME_LEN: usize = 50;

/// One builder method per property, shared by the three property types: `builders!(Type {
/// property, .. })` gives `Type` a `with_<property>` for each property it lists.
macro_rules! builders {
    ($ty:ident { $($property:ident),* $(,)? }) => {
        impl $ty {
            $(builder!($property);)*
        }
    };
}

/// The builder method of one property (see [`builders!`]).
macro_rules! builder {
    (lock_duration) => {
        /// Sets `LockDuration`.
        #[must_use]
        pub fn with_lock_duration(mut self, d: Duration) -> Self {
            self.lock_duration = d;
            self
        }
    };
    (max_delivery_count) => {
        /// Sets `MaxDeliveryCount`.
        #[must_use]
        pub fn with_max_delivery_count(mut self, n: u32) -> Self {
            self.max_delivery_count = n;
            self
        }
    };
    (default_message_time_to_live) => {
        /// Sets `DefaultMessageTimeToLive`.
        #[must_use]
        pub fn with_default_message_time_to_live(mut self, d: Duration) -> Self {
            self.default_message_time_to_live = Some(d);
            self
        }
    };
    (dead_lettering_on_message_expiration) => {
        /// Sets `DeadLetteringOnMessageExpiration`.
        #[must_use]
        pub fn with_dead_lettering_on_message_expiration(mut self, on: bool) -> Self {
            self.dead_lettering_on_message_expiration = on;
            self
        }
    };
    (duplicate_detection) => {
        /// Turns duplicate detection on with this window.
        #[must_use]
        pub fn with_duplicate_detection(mut self, window: Duration) -> Self {
            self.requires_duplicate_detection = true;
            self.duplicate_detection_history_time_window = window;
            self
        }
    };
    (requires_session) => {
        /// Sets `RequiresSession`.
        #[must_use]
        pub fn with_requires_session(mut self, on: bool) -> Self {
            self.requires_session = on;
            self
        }
    };
    (forward_to) => {
        /// Sets `ForwardTo`.
        #[must_use]
        pub fn with_forward_to(mut self, to: impl Into<String>) -> Self {
            self.forward_to = Some(to.into());
            self
        }
    };
    (max_size_in_megabytes) => {
        /// Sets `MaxSizeInMegabytes`.
        #[must_use]
        pub fn with_max_size_in_megabytes(mut self, megabytes: u64) -> Self {
            self.max_size_in_megabytes = megabytes;
            self
        }
    };
    (forward_dead_lettered_messages_to) => {
        /// Sets `ForwardDeadLetteredMessagesTo`.
        #[must_use]
        pub fn with_forward_dead_lettered_messages_to(mut self, to: impl Into<String>) -> Self {
            self.forward_dead_lettered_messages_to = Some(to.into());
            self
        }
    };
}

builders!(QueueProperties {
    lock_duration,
    max_size_in_megabytes,
    max_delivery_count,
    default_message_time_to_live,
    dead_lettering_on_message_expiration,
    duplicate_detection,
    requires_session,
    forward_to,
    forward_dead_lettered_messages_to,
});

builders!(TopicProperties {
    default_message_time_to_live,
    duplicate_detection,
    max_size_in_megabytes,
});

builders!(SubscriptionProperties {
    lock_duration,
    max_delivery_count,
    default_message_time_to_live,
    dead_lettering_on_message_expiration,
    requires_session,
    forward_to,
    forward_dead_lettered_messages_to,
});

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
    /// The most the entity holds, in MiB (`MaxSizeInMegabytes`): a send that would take it
    /// past this fails with [`Error::QuotaExceeded`]. Kept in the log by a record of its own
    /// (the entity record's encoding predates it), so it survives restarts.
    #[serde(skip, default = "default_max_size_in_megabytes")]
    pub max_size_in_megabytes: u64,
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
            max_size_in_megabytes: DEFAULT_MAX_SIZE_IN_MEGABYTES,
        }
    }
}

impl QueueProperties {
    /// Checks every property against its range.
    pub fn validate(&self) -> Result<(), Error> {
        validate_lock_duration(self.lock_duration)?;
        validate_max_delivery_count(self.max_delivery_count)?;
        validate_ttl(self.default_message_time_to_live)?;
        validate_dedup_window(self.duplicate_detection_history_time_window)?;
        validate_max_size(self.max_size_in_megabytes)?;
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
    /// The most the entity holds, in MiB (`MaxSizeInMegabytes`): a send that would take it
    /// past this fails with [`Error::QuotaExceeded`]. Kept in the log by a record of its own
    /// (the entity record's encoding predates it), so it survives restarts.
    #[serde(skip, default = "default_max_size_in_megabytes")]
    pub max_size_in_megabytes: u64,
}

impl Default for TopicProperties {
    fn default() -> Self {
        Self {
            default_message_time_to_live: None,
            requires_duplicate_detection: false,
            duplicate_detection_history_time_window: Duration::from_secs(600),
            max_size_in_megabytes: DEFAULT_MAX_SIZE_IN_MEGABYTES,
        }
    }
}

impl TopicProperties {
    /// Checks every property against its range.
    pub fn validate(&self) -> Result<(), Error> {
        validate_ttl(self.default_message_time_to_live)?;
        validate_dedup_window(self.duplicate_detection_history_time_window)?;
        validate_max_size(self.max_size_in_megabytes)
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
/// its rules' filters matches. The rules without an action give one copy between them, however
/// many match; each matching rule with an action gives a copy of its own, changed by the action
/// and carrying the application property `RuleName` (as Service Bus does).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Rule {
    /// The rule name.
    pub name: String,
    /// Which messages it selects.
    pub filter: Filter,
    /// What it changes in the copy it selects (a `SqlRuleAction`).
    pub action: Option<SqlAction>,
}

impl Rule {
    /// The name of the rule a subscription gets when it is created without rules.
    pub const DEFAULT_NAME: &'static str = "$Default";

    /// A rule with this name and filter, and no action.
    pub fn new(name: impl Into<String>, filter: Filter) -> Self {
        Self { name: name.into(), filter, action: None }
    }

    /// Sets the action.
    #[must_use]
    pub fn with_action(mut self, action: SqlAction) -> Self {
        self.action = Some(action);
        self
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
    /// A SQL filter expression ([`crate::sql`]).
    Sql(SqlFilter),
}

impl Filter {
    /// Whether the filter selects the message.
    pub fn matches(&self, message: &Message) -> bool {
        match self {
            Filter::True => true,
            Filter::False => false,
            Filter::Sql(f) => f.matches(message),
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

/// Serde's default of a field the log does not keep.
fn default_max_size_in_megabytes() -> u64 {
    DEFAULT_MAX_SIZE_IN_MEGABYTES
}

fn validate_max_size(megabytes: u64) -> Result<(), Error> {
    if megabytes == 0 || megabytes > MAX_MAX_SIZE_IN_MEGABYTES {
        return Err(Error::InvalidProperty {
            property: "MaxSizeInMegabytes",
            reason: format!("{megabytes} is outside 1..={MAX_MAX_SIZE_IN_MEGABYTES}"),
        });
    }
    Ok(())
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
