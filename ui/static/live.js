// Live updates of an operation's page: the server says when the operation changed
// (server-sent events from the broker's watch); the page is then fetched again and its
// operation section replaced. Without JavaScript the page works, without updating.
"use strict";
(function () {
  var section = document.getElementById("operation");
  if (!section || !section.dataset.live || !window.EventSource) { return; }
  var events = new EventSource(section.dataset.live);
  var shown = Number(section.dataset.revision);
  function refresh(revision) {
    if (revision <= shown) { return; }
    fetch(window.location.href, { credentials: "same-origin" }).then(function (r) {
      return r.ok ? r.text() : null;
    }).then(function (html) {
      if (!html) { return; }
      var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("operation");
      var current = document.getElementById("operation");
      if (!fresh || !current) { return; }
      shown = Number(fresh.dataset.revision);
      document.title = new DOMParser().parseFromString(html, "text/html").title;
      current.replaceWith(fresh);
      if (!fresh.dataset.live) { events.close(); }
    });
  }
  ["snapshot", "change", "heartbeat"].forEach(function (name) {
    events.addEventListener(name, function (e) { refresh(Number(e.data)); });
  });
  events.addEventListener("end", function () { events.close(); });
})();
