// The review queue's one script: when the page of a trace the queue holds for this
// reviewer is left (another page, a closed tab), the hold is released at once, so that
// the trace goes to the next reviewer instead of waiting for the hold to expire.
// Without it (scripts off) the hold simply expires.
"use strict";
(function () {
  const section = document.querySelector("[data-held]");
  const form = section && section.querySelector("form.review-form");
  if (!section || !form || !navigator.sendBeacon) return;
  const body = new URLSearchParams();
  body.set("trace_id", section.dataset.held);
  for (const input of form.querySelectorAll("input[type=hidden]")) {
    if (input.name !== "queue") body.set(input.name, input.value);
  }
  window.addEventListener("pagehide", function () {
    navigator.sendBeacon("/ui/review/release", body);
  });
})();
