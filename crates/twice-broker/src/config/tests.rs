use std::time::Duration;

use twice::{Message, Value};

use super::*;
use crate::error::Error;
use crate::sql::SqlAction;

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
    let rule = &t.subscriptions[3].2[0];
    let Filter::Sql(f) = &rule.filter else { panic!("{rule:?}") };
    assert_eq!(f.expression(), "sys.MessageId = '123456' AND userProp1 = 'value1'");
    assert_eq!(rule.action.as_ref().map(SqlAction::expression), Some("SET sys.To = 'Entity'"));
}

#[test]
fn the_whole_sample_gives_entities_and_routes_as_the_emulator_would() {
    let entities = Config::from_json(SAMPLE).unwrap().entities().unwrap();
    let paths: Vec<String> = entities.iter().map(EntityDefinition::path).collect();
    assert_eq!(
        paths,
        [
            "queue.1",
            "topic.1",
            "topic.1/Subscriptions/subscription.1",
            "topic.1/Subscriptions/subscription.2",
            "topic.1/Subscriptions/subscription.3",
            "topic.1/Subscriptions/subscription.4"
        ]
    );
    for e in &entities {
        e.validate().unwrap();
    }
    let EntityDefinition::Subscription { rules, .. } = &entities[5] else { panic!() };
    let mut m = Message::new("").with_message_id("123456");
    m.application_properties.insert("userProp1".into(), "value1".into());
    assert!(rules[0].filter.matches(&m));
    rules[0].action.as_ref().unwrap().apply(&mut m);
    assert_eq!(m.to.as_deref(), Some("Entity"));
    m.application_properties.insert("userProp1".into(), "value2".into());
    assert!(!rules[0].filter.matches(&m));
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
        &queue(r#""DuplicateDetectionHistoryTimeWindow":"PT4S""#),
        &format!("{q}.DuplicateDetectionHistoryTimeWindow: PT4S is outside PT5S..=P7D"),
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
                 LockDuration, MaxDeliveryCount, MaxSizeInMegabytes, RequiresDuplicateDetection, \
                 RequiresSession)"
        ),
    );
}

#[test]
fn topic_subscription_and_rule_errors_name_their_path() {
    let t = r#"{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[],"Topics":[{"Name":"t","Properties":{"LockDuration":"PT1M"},"Subscriptions":[]}]}]}}"#;
    check_err(
        t,
        "UserConfig.Namespaces[0].Topics[0].Properties.LockDuration: unknown property \"LockDuration\" (expected one \
             of: DefaultMessageTimeToLive, DuplicateDetectionHistoryTimeWindow, MaxSizeInMegabytes, \
             RequiresDuplicateDetection)",
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
            r#"{"Name":"r","Properties":{"FilterType":"Sql","SqlFilter":{"SqlExpression":"a = = 1"}}}"#,
        ),
        &format!(
            "{s}.Rules[0].Properties.SqlFilter.SqlExpression: expected an expression, found '=' at \
             position 4 in \"a = = 1\""
        ),
    );
    check_err(
        &sub(
            "",
            r#"{"Name":"r","Properties":{"FilterType":"Correlation","CorrelationFilter":{"Label":"a"},"Action":{"SqlExpression":"SET"}}}"#,
        ),
        &format!(
            "{s}.Rules[0].Properties.Action.SqlExpression: expected a property name, found the end \
             of the expression at position 3 in \"SET\""
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
        &format!("ok: {:?}", [EntityDefinition::queue("q", emulator_defaults())]),
    );
}

#[test]
fn omitted_properties_take_the_emulators_defaults_and_a_5_second_window_is_allowed() {
    let config = Config::from_json(
        r#"{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[{"Name":"q"},{"Name":"w","Properties":{"DuplicateDetectionHistoryTimeWindow":"PT5S","MaxDeliveryCount":10}}],"Topics":[{"Name":"t","Subscriptions":[{"Name":"s"}]}]}]}}"#,
    )
    .unwrap();
    let (_, q) = &config.namespaces[0].queues[0];
    assert_eq!(q.max_delivery_count, 3);
    assert_eq!(q.default_message_time_to_live, Some(Duration::from_secs(3600)));
    assert_eq!(q.duplicate_detection_history_time_window, Duration::from_secs(20));
    let (_, w) = &config.namespaces[0].queues[1];
    assert_eq!(
        (w.max_delivery_count, w.duplicate_detection_history_time_window.as_secs()),
        (10, 5)
    );
    let t = &config.namespaces[0].topics[0];
    assert_eq!(t.properties.default_message_time_to_live, Some(Duration::from_secs(3600)));
    assert_eq!(t.subscriptions[0].1.max_delivery_count, 3);
    // Created through the API, an entity takes Service Bus's defaults.
    assert_eq!(QueueProperties::default().max_delivery_count, 10);
    assert_eq!(QueueProperties::default().default_message_time_to_live, None);
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
    for bad in
        ["", "P", "PT", "1M", "PT1X", "P1S", "PT1S1M", "PT-1S", "P1DT", "PT.5S", "PT1.2.3S", "pt1m"]
    {
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

#[test]
fn a_key_given_twice_is_rejected() {
    let json = r#"{ "UserConfig": { "Namespaces": [{ "Name": "ns", "Queues": [
        { "Name": "q", "Properties": { "LockDuration": "PT5M", "LockDuration": "PT5S" } }
    ] }] } }"#;
    match Config::from_json(json) {
        Err(Error::Config { message, .. }) => {
            assert!(message.contains(r#"duplicate key "LockDuration""#), "{message}");
            assert!(message.contains("line 2"), "{message}");
        }
        other => panic!("a duplicate key was accepted: {other:?}"),
    }
    // The same name in two objects is no duplicate.
    let json = r#"{ "UserConfig": { "Namespaces": [{ "Name": "ns", "Queues": [
        { "Name": "a" }, { "Name": "b" }
    ] }] } }"#;
    assert_eq!(Config::from_json(json).unwrap().namespaces[0].queues.len(), 2);
}

#[test]
fn a_duration_that_overflows_is_rejected() {
    // The minutes alone fit in 128 bits of nanoseconds; with the fraction they do not, and
    // would wrap around to a few seconds.
    let huge = "PT5671372782015641057722910123.999999999M";
    assert!(parse_duration(huge).is_err(), "{huge} parsed");
    let json = format!(
        r#"{{ "UserConfig": {{ "Namespaces": [{{ "Name": "ns", "Queues": [
            {{ "Name": "q", "Properties": {{ "LockDuration": "{huge}" }} }}
        ] }}] }} }}"#
    );
    match Config::from_json(&json) {
        Err(Error::Config { path, .. }) => {
            assert_eq!(path, "UserConfig.Namespaces[0].Queues[0].Properties.LockDuration");
        }
        other => panic!("an overflowing LockDuration was accepted: {other:?}"),
    }
}
