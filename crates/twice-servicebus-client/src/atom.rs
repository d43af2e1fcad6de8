//! Reading the administration API's answers: an HTTP/1.1 response read to its end, and the
//! ATOM entries' elements and durations as Service Bus writes them. The client reads entity
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

/// The text of the first element `name` (with or without a namespace prefix), unescaped.
pub fn element(xml: &str, name: &str) -> Option<String> {
    let mut from = 0;
    while let Some(at) = xml[from..].find('<').map(|i| i + from) {
        let rest = &xml[at + 1..];
        let end = rest.find(['>', ' ', '/'])?;
        let tag = &rest[..end];
        let local = tag.rsplit(':').next().unwrap_or(tag);
        if local == name && !tag.starts_with('/') {
            let open_end = at + 1 + rest.find('>')?;
            if xml[..open_end].ends_with('/') {
                return Some(String::new());
            }
            let body = &xml[open_end + 1..];
            let close = body.find("</")?;
            return Some(unescape(&body[..close]));
        }
        from = at + 1;
    }
    None
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// An ISO-8601 duration as Service Bus writes them (`PT30S`, `P14D`, `PT1M30.5S`).
pub fn iso_duration(s: &str) -> Option<Duration> {
    let rest = s.trim().strip_prefix('P')?;
    let (date, time) = rest.split_once('T').unwrap_or((rest, ""));
    let mut secs = 0f64;
    for (part, units) in [
        (date, &[('D', 86_400.0), ('W', 604_800.0)][..]),
        (time, &[('H', 3600.0), ('M', 60.0), ('S', 1.0)][..]),
    ] {
        let mut number = String::new();
        for c in part.chars() {
            if c.is_ascii_digit() || c == '.' {
                number.push(c);
                continue;
            }
            let unit = units.iter().find(|(u, _)| *u == c)?.1;
            secs += number.parse::<f64>().ok()? * unit;
            number.clear();
        }
        if !number.is_empty() {
            return None;
        }
    }
    Duration::try_from_secs_f64(secs).ok()
}
