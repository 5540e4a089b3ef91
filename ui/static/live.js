// Live updates of an operation's page: the server says when the operation changed
// (server-sent events from the broker's watch); the page is then fetched again and its
// operation section replaced. Without JavaScript the page works, without updating.
"use strict";
(function () {
  var section = document.getElementById("operation");
  if (!section || !section.dataset.live || !window.EventSource) { return; }
  var url = section.dataset.live;
  var shown = Number(section.dataset.revision);
  var events = null;
  var announce = document.getElementById("live-status");
  var refused = 0; // streams turned away in a row for a while (busy), each followed by a retry
  var paused = false; // the page says so
  var retry = null; // the timer of the next try after a busy answer
  var longestWait = 30000; // milliseconds
  function busy(e) {
    // The first are most often a reload's own previous stream, not yet given back: say
    // nothing unless they go on.
    refused += 1;
    if (refused >= 3 && !paused && announce) {
      paused = true;
      announce.textContent = "Live updates paused: trying again.";
      announce.classList.remove("visually-hidden");
    }
    // The page asks again itself, after the wait the server names (in milliseconds; a
    // second if it names none), doubled for each further refusal in a row up to half a
    // minute (or the server's wait, if longer): a page left open while its principal
    // or tenant stays at a limit asks less and less often.
    var after = Number(e.data) > 0 ? Number(e.data) : 1000;
    var wait = Math.max(after, Math.min(longestWait, after * Math.pow(2, refused - 1)));
    if (events) { events.close(); events = null; }
    retry = setTimeout(function () { retry = null; open(); }, wait);
  }
  function resumed() {
    refused = 0;
    if (paused) {
      paused = false;
      announce.textContent = "Live updates resumed.";
      announce.classList.add("visually-hidden");
    }
  }
  function stopped() {
    close();
    url = null;
    if (announce) {
      announce.textContent = "Live updates stopped: reload the page to see the latest.";
      announce.classList.remove("visually-hidden");
    }
  }
  function refresh(revision) {
    if (revision <= shown) { return; }
    fetch(window.location.href, { credentials: "same-origin" }).then(function (r) {
      return r.ok && !r.redirected ? r.text() : null; // a redirect: the session ended
    }).then(function (html) {
      var fresh = html && new DOMParser().parseFromString(html, "text/html").getElementById("operation");
      var current = document.getElementById("operation");
      if (!fresh || !current) { stopped(); return; }
      shown = Number(fresh.dataset.revision);
      document.title = new DOMParser().parseFromString(html, "text/html").title;
      current.replaceWith(fresh);
      var headline = document.getElementById("headline");
      if (announce && headline) { announce.textContent = headline.textContent; }
      if (!fresh.dataset.live) { close(); url = null; }
    }).catch(stopped); // the network failed
  }
  function close() {
    if (events) { events.close(); events = null; }
    if (retry) { clearTimeout(retry); retry = null; }
    refused = 0;
  }
  // A hidden page gives its connection back (a browser keeps few per server), and
  // catches up when shown again: the stream starts with a snapshot.
  function open() {
    if (events || retry || !url || document.hidden) { return; }
    events = new EventSource(url);
    ["snapshot", "change", "heartbeat"].forEach(function (name) {
      events.addEventListener(name, function (e) { resumed(); refresh(Number(e.data)); });
    });
    events.addEventListener("busy", busy);
    events.addEventListener("end", function () { close(); url = null; });
    events.addEventListener("error", function () {
      // The browser connects again by itself after a broken stream (the state is then
      // CONNECTING); a refusal (the session ended, the operation is gone) closes it for
      // good. After a busy answer the page has closed it and asks again itself.
      if (events && events.readyState === EventSource.CLOSED) { stopped(); }
    });
  }
  document.addEventListener("visibilitychange", function () {
    if (document.hidden) { close(); } else { open(); }
  });
  window.addEventListener("pagehide", close);
  open();
})();
