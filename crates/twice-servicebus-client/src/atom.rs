//! Reading the administration API's answers: an HTTP/1.1 response read to its end, and the
//! ATOM entries' elements (read with `quick-xml`) and durations as Service Bus writes them. The client reads entity
//! properties with them, and twice's tools their counts.

use std::time::Duration;

/// The status and body of an HTTP/1.1 response read to its end (by its `Content-Length`,
/// its chunks, or the connection's close); the error says in one line what is not HTTP in it.
pub fn parse_response(raw: &[u8]) -> Result<(u16, String), String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| "the response has no end of headers".to_owned())?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .filter(|_| status_line.starts_with("HTTP/1."))
        .ok_or_else(|| format!("not an HTTP status line: {status_line:?}"))?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((k, v)) = line.split_once(':') else { continue };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        } else if k == "content-length" {
            length = v.parse::<usize>().ok();
        }
    }
    let body = if chunked {
        dechunk(body)?
    } else {
        match length {
            Some(n) if n <= body.len() => body[..n].to_vec(),
            Some(_) => return Err("the response ended before its Content-Length".into()),
            None => body.to_vec(),
        }
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| "a chunk size without its line end".to_owned())?;
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim().to_owned();
        let size = usize::from_str_radix(&size_text, 16)
            .map_err(|_| format!("a bad chunk size {size_text:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = b.get(..size).ok_or_else(|| "a chunk cut short".to_owned())?;
        out.extend_from_slice(chunk);
        b = b.get(size + 2..).unwrap_or_default();
    }
}

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
