//! A tiny HTTP/1.1 server on loopback for fetch tests: fixed routes, one response per
//! connection.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Serves until the test ends. Routes: `/img.png` (the body), `/redirect` (302 to
/// /img.png), `/loop` (302 to itself), `/big` (chunked, endless), `/slow` (headers, then
/// nothing), `/missing` (404), `/to-metadata` (302 to 169.254.169.254).
pub async fn start(png: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { return };
            let png = png.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                while !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => n += k,
                    }
                }
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                let redirect = |to: &str| format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\n\r\n");
                match path.as_str() {
                    "/img.png" => {
                        let h = format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\n\r\n",
                            png.len()
                        );
                        let _ = sock.write_all(h.as_bytes()).await;
                        let _ = sock.write_all(&png).await;
                    }
                    "/redirect" => drop(sock.write_all(redirect("/img.png").as_bytes()).await),
                    "/loop" => drop(sock.write_all(redirect("/loop").as_bytes()).await),
                    "/to-metadata" => {
                        drop(sock.write_all(redirect("http://169.254.169.254/latest/meta-data/").as_bytes()).await)
                    }
                    "/big" => {
                        let _ = sock.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").await;
                        let chunk = vec![b'x'; 65536];
                        loop {
                            let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
                            frame.extend_from_slice(&chunk);
                            frame.extend_from_slice(b"\r\n");
                            if sock.write_all(&frame).await.is_err() {
                                return;
                            }
                        }
                    }
                    "/slow" => {
                        let _ = sock.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n").await;
                        std::future::pending::<()>().await;
                    }
                    _ => drop(sock.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n").await),
                }
            });
        }
    });
    addr
}
