//! A small W3C WebDriver client: `chromedriver` as a child process on a free port, driven with
//! JSON over plain HTTP, one request per connection.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use serde_json::{Value as Json, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long [`Browser::wait_for`] waits for a condition.
const WAIT: Duration = Duration::from_secs(20);

/// `chromedriver` and one headless Chromium session; both end when this is dropped.
pub struct Browser {
    driver: tokio::process::Child,
    addr: SocketAddr,
    session: String,
    _profile: tempfile::TempDir,
}

/// The Debian paths of the browser and its driver.
pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

impl Browser {
    /// Starts `chromedriver` and a headless Chromium with a fresh profile.
    pub async fn start() -> anyhow::Result<Self> {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let driver = tokio::process::Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting chromedriver")?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let profile = tempfile::tempdir()?;
        let mut browser = Self { driver, addr, session: String::new(), _profile: profile };
        let mut ready = false;
        for _ in 0..100 {
            if let Ok(v) = browser.call("GET", "/status", None).await
                && v["ready"] == true
            {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !ready {
            bail!("chromedriver did not get ready on port {port}");
        }
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1360,900", "--hide-scrollbars", "--no-first-run",
                    format!("--user-data-dir={}", browser._profile.path().display()),
                ],
            },
        }}});
        let v = browser.call("POST", "/session", Some(caps)).await?;
        browser.session =
            v["sessionId"].as_str().ok_or_else(|| anyhow!("no session id in {v}"))?.to_owned();
        Ok(browser)
    }

    /// One WebDriver command; returns its `value`, or the WebDriver error as an error.
    async fn call(&self, method: &str, path: &str, body: Option<Json>) -> anyhow::Result<Json> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = tokio::net::TcpStream::connect(self.addr).await?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let mut raw = Vec::new();
        let mut chunk = vec![0u8; 65536];
        // Read the head, then as many bytes as it announces.
        let (head_len, length) = loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                bail!("chromedriver closed the connection: {}", String::from_utf8_lossy(&raw));
            }
            raw.extend_from_slice(&chunk[..n]);
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .ok_or_else(|| anyhow!("no content-length in {head}"))?;
                break (end + 4, length);
            }
        };
        while raw.len() < head_len + length {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                bail!("chromedriver's answer ended early");
            }
            raw.extend_from_slice(&chunk[..n]);
        }
        let v: Json = serde_json::from_slice(&raw[head_len..head_len + length])?;
        let value = v["value"].clone();
        if let Some(error) = value.get("error").and_then(Json::as_str) {
            bail!("{method} {path}: {error}: {}", value["message"]);
        }
        Ok(value)
    }

    async fn session_call(&self, method: &str, path: &str, body: Json) -> anyhow::Result<Json> {
        let body = if method == "GET" { None } else { Some(body) };
        self.call(method, &format!("/session/{}{path}", self.session), body).await
    }

    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.session_call("POST", "/url", json!({ "url": url })).await.map(drop)
    }

    /// The element `css` selects, once one exists.
    pub async fn find(&self, css: &str) -> anyhow::Result<String> {
        let body = json!({ "using": "css selector", "value": css });
        let v = self.session_call("POST", "/element", body).await?;
        // The element reference is the one value of the object (its key is a fixed UUID).
        v.as_object()
            .and_then(|o| o.values().next())
            .and_then(Json::as_str)
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("no element reference in {v}"))
    }

    pub async fn click(&self, css: &str) -> anyhow::Result<()> {
        let e = self.find(css).await?;
        self.session_call("POST", &format!("/element/{e}/click"), json!({})).await.map(drop)
    }

    pub async fn type_into(&self, css: &str, text: &str) -> anyhow::Result<()> {
        let e = self.find(css).await?;
        self.session_call("POST", &format!("/element/{e}/clear"), json!({})).await?;
        self.session_call("POST", &format!("/element/{e}/value"), json!({ "text": text }))
            .await
            .map(drop)
    }

    /// The rendered text of the element `css` selects.
    pub async fn text(&self, css: &str) -> anyhow::Result<String> {
        let e = self.find(css).await?;
        let v = self.session_call("GET", &format!("/element/{e}/text"), json!({})).await?;
        Ok(v.as_str().unwrap_or_default().to_owned())
    }

    /// Waits until the element `css` selects exists and `check` accepts its text; returns
    /// the text, or an error saying what was last seen.
    pub async fn wait_for(
        &self,
        css: &str,
        what: &str,
        check: impl Fn(&str) -> bool,
    ) -> anyhow::Result<String> {
        let mut last = String::from("(no such element)");
        for _ in 0..(WAIT.as_millis() / 100) {
            match self.text(css).await {
                Ok(t) if check(&t) => return Ok(t),
                Ok(t) => last = t,
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("waited {WAIT:?} for {css} to show {what}; last seen: {last}")
    }

    /// Saves a PNG of the window to `path`.
    pub async fn screenshot(&self, path: &Path) -> anyhow::Result<()> {
        use base64::Engine as _;
        let v = self.session_call("GET", "/screenshot", json!({})).await?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().ok_or_else(|| anyhow!("no screenshot data"))?)?;
        std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
    }

    /// Ends the browser session and the driver.
    pub async fn quit(mut self) {
        let path = format!("/session/{}", self.session);
        let _ = self.call("DELETE", &path, None).await;
        let _ = self.driver.kill().await;
    }
}
