//! Reading the administration API's answers (fetched with [`crate::http`]): the ATOM entries'
//! elements (read with `quick-xml`) and durations as Service Bus writes them. The client reads
//! entity properties with them, and twice's tools their counts.

use std::time::Duration;

/// The text of the first element `name` (with or without a namespace prefix), unescaped and
/// trimmed; empty for `<name/>`; `None` when there is none or the XML does not parse.
pub fn element(xml: &str, name: &str) -> Option<String> {
    let mut found = None;
    each_element(xml, name, |inner| {
        found = Some(inner.map_or_else(String::new, |raw| {
            quick_xml::escape::unescape(raw.trim())
                .map_or_else(|_| raw.trim().to_owned(), |t| t.into_owned())
        }));
        false
    });
    found
}

/// The raw content of every element `name` (with or without a namespace prefix), in document
/// order: an ATOM feed's entries, for example.
pub fn blocks(xml: &str, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    each_element(xml, name, |inner| {
        out.push(inner.unwrap_or_default().to_owned());
        true
    });
    out
}

/// Calls `f` with the raw content of each element `name` (`None` for an empty one), until it
/// returns `false`, the document ends, or the XML stops parsing.
fn each_element(xml: &str, name: &str, mut f: impl FnMut(Option<&str>) -> bool) {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_str(xml);
    loop {
        let more = match reader.read_event() {
            Ok(Event::Start(e)) if e.local_name().as_ref() == name.as_bytes() => {
                let end = e.to_end().into_owned();
                match reader.read_text(end.name()) {
                    Ok(text) => f(Some(&text)),
                    Err(_) => return,
                }
            }
            Ok(Event::Empty(e)) if e.local_name().as_ref() == name.as_bytes() => f(None),
            Ok(Event::Eof) | Err(_) => return,
            Ok(_) => true,
        };
        if !more {
            return;
        }
    }
}

/// An ISO-8601 duration as Service Bus writes them (`PT30S`, `P14D`, `PT1M30.5S`), read with
/// [`twice::iso_duration::parse_duration`].
pub fn iso_duration(s: &str) -> Option<Duration> {
    twice::iso_duration::parse_duration(s.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_found_by_local_name_unescaped_and_empty_ones_are_empty() {
        let feed = r#"<feed xmlns="http://www.w3.org/2005/Atom"><entry><title>a &amp; b</title>
            <content><d:Status xmlns:d="x">Active</d:Status><UserMetadata/></content></entry>
            <entry><title>c</title></entry></feed>"#;
        assert_eq!(element(feed, "title").as_deref(), Some("a & b"));
        assert_eq!(element(feed, "Status").as_deref(), Some("Active"));
        assert_eq!(element(feed, "UserMetadata").as_deref(), Some(""));
        assert_eq!(element(feed, "Missing"), None);
        let entries = blocks(feed, "entry");
        assert_eq!(entries.len(), 2);
        assert_eq!(element(&entries[1], "title").as_deref(), Some("c"));
        // A document cut short yields what came before the cut, and nothing made up.
        assert_eq!(blocks("<feed><entry>x</entry><entry>y", "entry"), vec!["x".to_owned()]);
        assert_eq!(iso_duration(" PT1M30.5S "), Some(Duration::from_millis(90_500)));
        assert_eq!(iso_duration("1M"), None);
    }
}
