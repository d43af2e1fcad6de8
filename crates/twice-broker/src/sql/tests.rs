use proptest::prelude::*;
use twice::{Message, Value};

use super::{SqlAction, SqlFilter};

fn message() -> Message {
    let mut m = Message::new("12345")
        .with_message_id("m-1")
        .with_subject("rush-order")
        .with_correlation_id("c-9")
        .with_content_type("application/json");
    let p = &mut m.application_properties;
    p.insert("color".into(), "red".into());
    p.insert("quantity".into(), Value::Int(12));
    p.insert("price".into(), Value::Double(9.5));
    p.insert("big".into(), Value::Ulong(u64::MAX));
    p.insert("flag".into(), Value::Bool(true));
    p.insert("nothing".into(), Value::Null);
    p.insert("initial".into(), Value::Char('r'));
    p.insert("Mixed Case.name".into(), "x".into());
    p.insert("100%".into(), "literal".into());
    m
}

/// `expect`: `t` (selects), `f` (does not select: false or unknown), or `e@N` (a parse error
/// at byte N).
fn check(expr: &str, expect: &str) {
    let m = message();
    let got = match SqlFilter::parse(expr) {
        Ok(f) => (if f.matches(&m) { "t" } else { "f" }).to_owned(),
        Err(e) => format!("e@{}", e.position),
    };
    assert_eq!(got, expect, "{expr}");
}

#[test]
fn comparisons_and_coercion() {
    check("color = 'red'", "t");
    check("color = 'Red'", "f");
    check("color <> 'blue' AND color != 'green'", "t");
    check("quantity > 10", "t");
    check("quantity >= 12 AND quantity <= 12", "t");
    check("quantity < 12.5", "t");
    check("price = 9.5", "t");
    check("price > 9", "t");
    check("big > 9223372036854775807", "t");
    check("flag = TRUE", "t");
    check("flag", "t");
    check("initial = 'r'", "t");
    check("color > 'blue'", "t");
    // No conversion between strings and numbers: unknown, so neither = nor <> selects.
    check("quantity = '12'", "f");
    check("quantity <> '12'", "f");
    check("flag > FALSE", "f");
}

#[test]
fn system_properties() {
    check("sys.Label = 'rush-order'", "t");
    check("sys.label = 'rush-order'", "t");
    check("SYS.MessageId = 'm-1' AND sys.CorrelationId = 'c-9'", "t");
    check("sys.Size = 5", "t");
    check("sys.To IS NULL", "t");
    check("EXISTS(sys.ContentType) AND NOT EXISTS(sys.ReplyTo)", "t");
    check("sys.Nope = 1", "e@4");
    check("property('sys.Label') = 'rush-order'", "t");
    check("property('color') = 'red'", "t");
}

#[test]
fn user_scope_and_quoted_names() {
    check("user.color = 'red'", "t");
    check("[Mixed Case.name] = 'x'", "t");
    check("\"Mixed Case.name\" = 'x'", "t");
    check("user.[100%] = 'literal'", "t");
    check("[and] IS NULL", "t");
    check("and = 1", "e@0");
}

#[test]
fn three_valued_logic() {
    check("missing = 1", "f");
    check("NOT (missing = 1)", "f");
    check("missing = 1 OR color = 'red'", "t");
    check("missing = 1 AND color = 'blue'", "f");
    check("NOT (missing = 1 AND color = 'blue')", "t");
    check("missing IS NULL AND nothing IS NULL AND color IS NOT NULL", "t");
    check("EXISTS(nothing) AND NOT EXISTS(missing)", "t");
    check("NULL = NULL", "f");
    check("missing + 1 > 0", "f");
}

#[test]
fn in_and_like() {
    check("color IN ('blue', 'red')", "t");
    check("color NOT IN ('blue', 'green')", "t");
    check("quantity IN (1, 2, 12.0)", "t");
    check("color IN ('blue', missing)", "f");
    check("color NOT IN ('blue', missing)", "f");
    check("color IN ('red', missing)", "t");
    check("sys.Label LIKE 'rush%'", "t");
    check("sys.Label LIKE '%order'", "t");
    check("sys.Label LIKE 'r_sh-%r'", "t");
    check("sys.Label LIKE 'rush'", "f");
    check("sys.Label NOT LIKE '%x%'", "t");
    check("[100%] LIKE 'lit%'", "t");
    check("'100%' LIKE '100!%' ESCAPE '!'", "t");
    check("'1000' LIKE '100!%' ESCAPE '!'", "f");
    check("'a_b' LIKE 'a\\_b' ESCAPE '\\'", "t");
    check("'axb' LIKE 'a\\_b' ESCAPE '\\'", "f");
    check("'%%%' LIKE '%%%'", "t");
    check("initial LIKE 'r'", "t");
    check("quantity LIKE '1%'", "f");
    check("color LIKE 'r%' ESCAPE 'ab'", "e@23");
    check("color LIKE 'r!' ESCAPE '!'", "e@11");
}

#[test]
fn arithmetic() {
    check("quantity * 2 + 1 = 25", "t");
    check("quantity / 5 = 2", "t");
    check("quantity % 5 = 2", "t");
    check("quantity / 0 = 1", "f");
    check("quantity / 0 IS NULL", "t");
    check("-quantity = -12 AND - -quantity = 12", "t");
    check("price * 2 = 19", "t");
    check("9223372036854775807 + 1 IS NULL", "t");
    check("1 + 2 * 3 = 7 AND (1 + 2) * 3 = 9", "t");
    check("1.5E1 = 15 AND 2e-1 = 0.2 AND 3. = 3", "t");
}

#[test]
fn syntax_errors_carry_positions() {
    check("", "e@0");
    check("color = ", "e@8");
    check("color = 'red", "e@8");
    check("color == 'red'", "e@7");
    check("(color = 'red'", "e@14");
    check("color = 'red')", "e@13");
    check("color # 1", "e@6");
    check("color IN ()", "e@10");
    check("color NOT = 1", "e@10");
    check("99999999999999999999 = 1", "e@0");
    check(&"(".repeat(200), "e@64");
    let long = format!("color = '{}'", "x".repeat(5000));
    check(&long, "e@4096");
    let err = SqlFilter::parse("color = = 1").unwrap_err();
    assert_eq!(err.to_string(), "expected an expression, found '=' at position 8");
}

#[test]
fn newid_is_a_fresh_uuid() {
    check("newid() = newid()", "f");
    check("newid() IS NOT NULL", "t");
}

#[test]
fn actions_set_and_remove_in_order() {
    let mut m = message();
    SqlAction::parse(
        "SET priority = 'high'; SET doubled = quantity * 2; SET sys.Label = 'routed'; \
         SET again = doubled + 1; REMOVE color; REMOVE sys.CorrelationId; SET gone = missing;",
    )
    .unwrap()
    .apply(&mut m);
    let p = &m.application_properties;
    assert_eq!(p["priority"].as_str(), Some("high"));
    assert_eq!(p["doubled"], Value::Long(24));
    assert_eq!(p["again"], Value::Long(25));
    assert_eq!(p["gone"], Value::Null);
    assert!(!p.contains_key("color"));
    assert_eq!(m.subject.as_deref(), Some("routed"));
    assert_eq!(m.correlation_id, None);

    for (bad, at) in [("", 0), ("SET", 3), ("SET x 1", 6), ("DROP x", 0), ("SET sys.Size = 1", 4)] {
        let err = SqlAction::parse(bad).unwrap_err();
        assert_eq!(err.position, at, "{bad}: {err}");
    }
}

// A reference model: random predicates over integer and string properties, rendered as text,
// parsed and evaluated, against a direct evaluation of the generated tree written here without
// the parser's types.

#[derive(Clone, Debug)]
enum R {
    Int(i64),
    Str(&'static str),
    Prop(&'static str),
    Add(Box<R>, Box<R>),
    Mul(Box<R>, Box<R>),
    Eq(Box<R>, Box<R>),
    Lt(Box<R>, Box<R>),
    And(Box<R>, Box<R>),
    Or(Box<R>, Box<R>),
    Not(Box<R>),
    IsNull(&'static str),
    In(Box<R>, Vec<R>),
    Like(&'static str, &'static str),
}

#[derive(Clone, Debug, PartialEq)]
enum RV {
    I(i64),
    S(String),
    B(bool),
}

const PROPS: [&str; 4] = ["a", "b", "s", "missing"];
const STRS: [&str; 4] = ["", "ab", "abc", "b"];
const PATTERNS: [&str; 6] = ["a%", "%b%", "_b_", "%", "abc", "a_"];

fn render(r: &R) -> String {
    match r {
        R::Int(n) if *n < 0 => format!("({n})"),
        R::Int(n) => n.to_string(),
        R::Str(s) => format!("'{s}'"),
        R::Prop(p) => format!("user.{p}"),
        R::Add(a, b) => format!("({} + {})", render(a), render(b)),
        R::Mul(a, b) => format!("({} * {})", render(a), render(b)),
        R::Eq(a, b) => format!("({} = {})", render(a), render(b)),
        R::Lt(a, b) => format!("({} < {})", render(a), render(b)),
        R::And(a, b) => format!("({} AND {})", render(a), render(b)),
        R::Or(a, b) => format!("({} or {})", render(a), render(b)),
        R::Not(a) => format!("(NOT {})", render(a)),
        R::IsNull(p) => format!("({p} IS NULL)"),
        R::In(a, list) => format!(
            "({} IN ({}))",
            render(a),
            list.iter().map(render).collect::<Vec<_>>().join(", ")
        ),
        R::Like(p, pat) => format!("({p} LIKE '{pat}')"),
    }
}

fn like_ref(p: &[char], s: &[char]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some(('%', rest)) => (0..=s.len()).any(|i| like_ref(rest, &s[i..])),
        Some(('_', rest)) => !s.is_empty() && like_ref(rest, &s[1..]),
        Some((c, rest)) => s.first() == Some(c) && like_ref(rest, &s[1..]),
    }
}

fn eval_ref(r: &R, props: &[(&str, RV)]) -> Option<RV> {
    let get = |p: &str| props.iter().find(|(k, _)| *k == p).map(|(_, v)| v.clone());
    let b = |x: &R| match eval_ref(x, props) {
        Some(RV::B(b)) => Some(b),
        _ => None,
    };
    match r {
        R::Int(n) => Some(RV::I(*n)),
        R::Str(s) => Some(RV::S((*s).to_owned())),
        R::Prop(p) => get(p),
        R::Add(x, y) | R::Mul(x, y) => match (eval_ref(x, props)?, eval_ref(y, props)?) {
            (RV::I(x), RV::I(y)) => {
                if matches!(r, R::Add(..)) { x.checked_add(y) } else { x.checked_mul(y) }.map(RV::I)
            }
            _ => None,
        },
        R::Eq(x, y) | R::Lt(x, y) => {
            let ord = match (eval_ref(x, props)?, eval_ref(y, props)?) {
                (RV::I(x), RV::I(y)) => x.cmp(&y),
                (RV::S(x), RV::S(y)) => x.cmp(&y),
                (RV::B(x), RV::B(y)) if matches!(r, R::Eq(..)) => x.cmp(&y),
                _ => return None,
            };
            Some(RV::B(if matches!(r, R::Eq(..)) { ord.is_eq() } else { ord.is_lt() }))
        }
        R::And(x, y) => match (b(x), b(y)) {
            (Some(false), _) | (_, Some(false)) => Some(RV::B(false)),
            (Some(true), Some(true)) => Some(RV::B(true)),
            _ => None,
        },
        R::Or(x, y) => match (b(x), b(y)) {
            (Some(true), _) | (_, Some(true)) => Some(RV::B(true)),
            (Some(false), Some(false)) => Some(RV::B(false)),
            _ => None,
        },
        R::Not(x) => b(x).map(|v| RV::B(!v)),
        R::IsNull(p) => Some(RV::B(get(p).is_none())),
        R::In(x, list) => {
            let v = eval_ref(x, props)?;
            let mut unknown = false;
            for item in list {
                match (eval_ref(item, props), &v) {
                    (Some(RV::I(a)), RV::I(b)) if a == *b => return Some(RV::B(true)),
                    (Some(RV::S(a)), RV::S(b)) if a == *b => return Some(RV::B(true)),
                    (Some(RV::I(_)), RV::I(_)) | (Some(RV::S(_)), RV::S(_)) => {}
                    _ => unknown = true,
                }
            }
            if unknown { None } else { Some(RV::B(false)) }
        }
        R::Like(p, pat) => match get(p)? {
            RV::S(s) => Some(RV::B(like_ref(
                &pat.chars().collect::<Vec<_>>(),
                &s.chars().collect::<Vec<_>>(),
            ))),
            _ => None,
        },
    }
}

fn value_tree() -> impl Strategy<Value = R> {
    let leaf = prop_oneof![
        (-3i64..4).prop_map(R::Int),
        prop::sample::select(&STRS[..]).prop_map(R::Str),
        prop::sample::select(&PROPS[..]).prop_map(R::Prop),
        Just(R::Int(i64::MAX)),
    ];
    leaf.prop_recursive(3, 8, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| R::Add(Box::new(a), Box::new(b))),
            (inner.clone(), inner).prop_map(|(a, b)| R::Mul(Box::new(a), Box::new(b))),
        ]
    })
}

fn predicate_tree() -> impl Strategy<Value = R> {
    let atom = prop_oneof![
        (value_tree(), value_tree()).prop_map(|(a, b)| R::Eq(Box::new(a), Box::new(b))),
        (value_tree(), value_tree()).prop_map(|(a, b)| R::Lt(Box::new(a), Box::new(b))),
        prop::sample::select(&PROPS[..]).prop_map(R::IsNull),
        (value_tree(), prop::collection::vec(value_tree(), 1..4))
            .prop_map(|(a, l)| R::In(Box::new(a), l)),
        (prop::sample::select(&PROPS[..]), prop::sample::select(&PATTERNS[..]))
            .prop_map(|(p, pat)| R::Like(p, pat)),
    ];
    atom.prop_recursive(4, 24, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| R::And(Box::new(a), Box::new(b))),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| R::Or(Box::new(a), Box::new(b))),
            inner.prop_map(|a| R::Not(Box::new(a))),
        ]
    })
}

fn rv_strategy() -> impl Strategy<Value = Option<RV>> {
    prop_oneof![
        Just(None),
        (-3i64..4).prop_map(|n| Some(RV::I(n))),
        prop::sample::select(&STRS[..]).prop_map(|s| Some(RV::S(s.to_owned()))),
        any::<bool>().prop_map(|b| Some(RV::B(b))),
    ]
}

proptest! {
    #[test]
    fn evaluation_agrees_with_the_reference_model(
        tree in predicate_tree(),
        a in rv_strategy(),
        b in rv_strategy(),
        s in rv_strategy(),
    ) {
        let mut m = Message::new("");
        let mut props = Vec::new();
        for (name, v) in [("a", a), ("b", b), ("s", s)] {
            if let Some(v) = v {
                let value = match &v {
                    RV::I(n) => Value::Long(*n),
                    RV::S(s) => Value::String(s.clone()),
                    RV::B(b) => Value::Bool(*b),
                };
                m.application_properties.insert(name.into(), value);
                props.push((name, v));
            }
        }
        let text = render(&tree);
        let filter = SqlFilter::parse(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        let expected = eval_ref(&tree, &props) == Some(RV::B(true));
        prop_assert_eq!(filter.matches(&m), expected, "{}", text);
    }

    #[test]
    fn any_text_parses_or_fails_at_a_position_inside_it(
        text in "[a-zA-Z0-9_ '\"\\[\\]().,;=<>!%*/+-]{0,64}",
    ) {
        if let Err(e) = SqlFilter::parse(&text) {
            prop_assert!(e.position <= text.len(), "{}: {}", text, e);
        }
        if let Err(e) = SqlAction::parse(&text) {
            prop_assert!(e.position <= text.len(), "{}: {}", text, e);
        }
    }
}

/// The pattern compiled as `LIKE 'pattern' ESCAPE '!'` would be.
fn like_pattern(pattern: &str) -> super::like::LikePattern {
    super::like::compile_like(pattern, Some('!'), 0).expect("a valid pattern")
}

/// How much work matching may take: a few machine words of state per pattern element and
/// per 64 of them, for each character of the value.
fn like_work_bound(pattern: &str, value: &str) -> u64 {
    let words = u64::try_from(pattern.chars().count() / 64 + 1).unwrap_or(u64::MAX);
    let chars = u64::try_from(value.chars().count()).unwrap_or(u64::MAX);
    2 * words * (chars + 1)
}

#[test]
fn like_does_work_linear_in_the_value_and_not_in_pattern_times_value() {
    // `%aaa…ab` (1,012 characters) against 240,000 `a`: a backtracking matcher retries the
    // whole pattern from every position of the value, some 240 million steps.
    let pattern = format!("%{}b", "a".repeat(1010));
    let value = "a".repeat(240_000);
    let like = like_pattern(&pattern);
    let mut steps = 0;
    assert!(!like.matches_counting(&value, &mut steps));
    let bound = like_work_bound(&pattern, &value);
    assert!(steps <= bound, "{steps} steps for {} characters, bound {bound}", value.len());
    let mut steps = 0;
    assert!(like.matches_counting(&format!("{value}b"), &mut steps));
    assert!(steps <= bound + 64, "{steps} steps");
    // Many `%`, each followed by the same near miss.
    let pattern = "%aaaaaaab".repeat(100);
    let value = "aaaaaaa".repeat(30_000);
    let mut steps = 0;
    assert!(!like_pattern(&pattern).matches_counting(&value, &mut steps));
    let bound = like_work_bound(&pattern, &value);
    assert!(steps <= bound, "{steps} steps, bound {bound}");
}

#[test]
fn a_filter_with_the_largest_pattern_evaluates_a_megabyte_value() {
    // 4,000 pattern characters against a million: four billion steps for a backtracking
    // matcher, some 63 million word operations here.
    let pattern = format!("%{}b", "a".repeat(3998));
    let filter = SqlFilter::parse(&format!("s LIKE '{pattern}'")).expect("parses");
    let mut m = Message::new("");
    m.application_properties.insert("s".into(), Value::String("a".repeat(1_000_000)));
    assert!(!filter.matches(&m));
    m.application_properties
        .insert("s".into(), Value::String(format!("{}b", "a".repeat(1_000_000))));
    assert!(filter.matches(&m));
}

/// A reference `LIKE` with `!` as its escape: plain recursion, exponential but obvious.
fn like_with_escape_ref(p: &[char], s: &[char]) -> bool {
    match p {
        [] => s.is_empty(),
        ['!', c, rest @ ..] => s.first() == Some(c) && like_with_escape_ref(rest, &s[1..]),
        ['%', rest @ ..] => (0..=s.len()).any(|i| like_with_escape_ref(rest, &s[i..])),
        ['_', rest @ ..] => !s.is_empty() && like_with_escape_ref(rest, &s[1..]),
        [c, rest @ ..] => s.first() == Some(c) && like_with_escape_ref(rest, &s[1..]),
    }
}

proptest! {
    #[test]
    fn like_agrees_with_a_reference_matcher(
        pattern in "([ab%_é]|![ab%_!é]){0,12}",
        value in "[ab%_!é]{0,16}",
    ) {
        let p: Vec<char> = pattern.chars().collect();
        let s: Vec<char> = value.chars().collect();
        let mut steps = 0;
        let got = like_pattern(&pattern).matches_counting(&value, &mut steps);
        prop_assert_eq!(got, like_with_escape_ref(&p, &s), "'{}' LIKE '{}' ESCAPE '!'", value, pattern);
        prop_assert!(steps <= like_work_bound(&pattern, &value) + 64);
    }
}
