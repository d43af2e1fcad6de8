//! One HTTP request as the console and the administration API take it, below both of them and
//! the listener of [`crate::http`] that reads it.

/// One HTTP request, read whole, as the console and the administration API take it.
#[derive(Debug)]
pub(crate) struct Request<'a> {
    pub(crate) method: &'a str,
    /// The path, percent-encoded, without the query.
    pub(crate) path: &'a str,
    pub(crate) query: &'a str,
    /// Headers with lowercase names.
    pub(crate) headers: &'a [(String, String)],
    pub(crate) body: &'a [u8],
}

impl Request<'_> {
    /// The value of a header, by its lowercase name.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}
