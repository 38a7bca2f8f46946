//! R-LIM-2: `decoded_size` bounds what a body's `serde_json::Value` tree
//! really takes. Measured with a counting allocator around the very parse
//! the API parsers start with, for the shapes an attacker would pick and
//! for real request bodies: the bound holds, and is not so loose that it
//! refuses honest requests.

// A counting global allocator needs `unsafe impl GlobalAlloc`; it only
// forwards to the system allocator.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use iop_edge::decoded_size::decoded_size;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            let live = LIVE.fetch_add(new_size - layout.size(), Ordering::SeqCst) + new_size
                - layout.size();
            PEAK.fetch_max(live, Ordering::SeqCst);
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The heap the parsed tree keeps (live after the parse, the tree held).
fn measured(body: &[u8]) -> usize {
    let before = LIVE.load(Ordering::SeqCst);
    let tree: serde_json::Value = serde_json::from_slice(body).expect("valid JSON");
    let kept = LIVE.load(Ordering::SeqCst) - before;
    drop(tree);
    kept + std::mem::size_of::<serde_json::Value>()
}

// One test: the counting allocator must see no other test's allocations.
#[test]
fn the_bound_holds_for_hostile_and_honest_bodies() {
    let bodies: Vec<(&str, String)> = vec![
        ("numbers", format!("[{}0]", "0,".repeat(200_000))),
        ("empty arrays", format!("[{}[]]", "[],".repeat(100_000))),
        (
            "one-element arrays",
            format!("[{}[0]]", "[0],".repeat(100_000)),
        ),
        (
            "small objects",
            format!("[{}{{\"\":0}}]", "{\"\":0},".repeat(100_000)),
        ),
        (
            "wide object",
            format!(
                "{{{}\"z\":0}}",
                (0..50_000)
                    .map(|i| format!("\"k{i}\":0,"))
                    .collect::<String>()
            ),
        ),
        (
            "nested",
            format!("{}0{}", "[{\"a\":".repeat(60), "}]".repeat(60)),
        ),
        (
            "escaped strings",
            format!("[{}\"\"]", "\"\\u0041\\n\",".repeat(50_000)),
        ),
        (
            "chat request",
            serde_json::json!({
                "model": "m", "stream": true, "temperature": 0.2,
                "messages": (0..200).map(|i| serde_json::json!({
                    "role": if i % 2 == 0 { "user" } else { "assistant" },
                    "content": "word ".repeat(200),
                })).collect::<Vec<_>>(),
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}}}}}],
            })
            .to_string(),
        ),
    ];
    for (shape, body) in &bodies {
        let real = measured(body.as_bytes());
        let bound = decoded_size(body.as_bytes()).unwrap();
        assert!(
            bound >= real,
            "{shape}: the bound {bound} is below the real {real} ({} wire bytes)",
            body.len()
        );
        assert!(
            bound <= 3 * real,
            "{shape}: the bound {bound} is more than 3x the real {real}"
        );
    }
    // The shapes really differ: small objects cost far more than 16x.
    let objects = &bodies[3].1;
    assert!(measured(objects.as_bytes()) > 40 * objects.len());
}
