//! One HTTP request as the console and the administration API take it, below both of them and
//! the listener of [`crate::http`] that receives it (hyper parses it; this is a borrowed view).

/// One HTTP request, received whole, as the console and the administration API take it.
#[derive(Debug)]
pub(crate) struct Request<'a> {
    pub(crate) method: &'a str,
    /// The path, percent-encoded, without the query.
    pub(crate) path: &'a str,
    pub(crate) query: &'a str,
    pub(crate) headers: &'a http::HeaderMap,
    pub(crate) body: &'a [u8],
}

impl Request<'_> {
    /// The value of a header (the first one of that name), by its lowercase name. The
    /// listener refuses a request whose header values are not UTF-8.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
    }
}
