// The status page in headless Chromium (Debian's chromium, driven by
// playwright-core), against a running delayd with a token and pending
// messages:
// - without the token the page asks for it and shows no cancel button, and
//   a forged cancel is refused;
// - with it, the counts on the page equal /v1/counts, the due-time columns
//   add up, and a cancel removes the message (GET /v1/messages/{id}: 404);
// - a screenshot is written.
// usage: node status_page.mjs BASE_URL TOKEN SCREENSHOT.png
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createRequire } from "node:module";

const require = createRequire(process.env.PLAYWRIGHT_CORE ?? import.meta.url);
const { chromium } = require("playwright-core");

const [base, token, screenshot] = process.argv.slice(2);
if (!screenshot) throw new Error("usage: node status_page.mjs BASE_URL TOKEN SCREENSHOT.png");

function check(ok, what) {
  if (!ok) throw new Error(`status page: ${what}`);
  console.log(`ok   ${what}`);
}

async function api(method, path, withToken = true) {
  const headers = withToken ? { authorization: `Bearer ${token}` } : {};
  const r = await fetch(base + path, { method, headers });
  return { status: r.status, body: await r.text() };
}

const userData = mkdtempSync(join(tmpdir(), "delayd-chromium-"));
const context = await chromium.launchPersistentContext(userData, {
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1360, height: 900 },
  args: [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
  ],
});
try {
  const page = context.pages()[0] ?? (await context.newPage());

  // Without the token.
  const first = await page.goto(base + "/");
  check(first.status() === 401, "without the token the page answers 401");
  check((await page.locator("form#login").count()) === 1, "without the token it asks for the token");
  check((await page.locator("button.cancel").count()) === 0, "without the token there is no cancel button");
  const listed = JSON.parse((await api("GET", "/v1/messages?limit=1")).body).items;
  check(listed.length === 1, "a message is pending for the forged cancel");
  const forged = await fetch(base + "/ui/cancel", {
    method: "POST",
    headers: { "content-type": "application/x-www-form-urlencoded" },
    body: `id=${encodeURIComponent(listed[0].id)}&csrf=x`,
    redirect: "manual",
  });
  check(forged.status === 403, `a cancel without the token is refused (${forged.status})`);
  check((await api("GET", `/v1/messages/${listed[0].id}`)).status === 200, "and the message is still pending");

  // With the token.
  await page.fill("input[name=token]", "wrong");
  await page.click("form#login button");
  check((await page.locator("form#login").count()) === 1, "a wrong token is refused");
  await page.fill("input[name=token]", token);
  await Promise.all([page.waitForLoadState(), page.click("form#login button")]);
  check((await page.locator("table#routes").count()) === 1, "with the token the page shows the routes");

  const counts = JSON.parse((await api("GET", "/v1/counts")).body);
  const onPage = {};
  for (const row of await page.locator("table#routes tbody tr").all()) {
    const route = await row.getAttribute("data-route");
    const cells = (await row.locator("td").allInnerTexts()).map((t) => t.trim());
    onPage[route] = cells;
  }
  const pageTotal = Number(await page.locator("#total-pending").innerText());
  check(pageTotal === counts.total, `total pending on the page (${pageTotal}) equals /v1/counts (${counts.total})`);
  check(
    JSON.stringify(Object.keys(onPage).sort()) === JSON.stringify(Object.keys(counts.routes).sort()),
    `the page lists the routes of /v1/counts (${Object.keys(counts.routes).join(", ")})`,
  );
  for (const [route, n] of Object.entries(counts.routes)) {
    const cells = onPage[route];
    const [pending, overdue, min, hour, day, later] = cells.slice(1, 7).map(Number);
    check(pending === n, `route ${route}: pending on the page (${pending}) equals /v1/counts (${n})`);
    check(overdue + day + later === pending && min <= hour && hour <= day,
      `route ${route}: overdue ${overdue} + within a day ${day} + later ${later} = pending, minute ${min} <= hour ${hour} <= day`);
  }
  check((await page.locator("table#brokers tbody tr").count()) >= 1, "the brokers' connections are shown");

  const rows = page.locator("table#pending tbody tr");
  check((await rows.count()) > 0, "the pending list shows messages");
  check((await page.locator("button.cancel").count()) === (await rows.count()), "each listed message has a cancel button");
  if (await page.locator("a#next").count()) {
    const firstId = await rows.first().getAttribute("data-id");
    await Promise.all([page.waitForLoadState(), page.click("a#next")]);
    const nextFirst = await page.locator("table#pending tbody tr").first().getAttribute("data-id");
    check(nextFirst && nextFirst !== firstId, "the next page lists other messages");
    await page.goto(base + "/");
  }
  await page.screenshot({ path: screenshot });
  console.log(`screenshot: ${screenshot}`);

  const victim = await page.locator("table#pending tbody tr").first().getAttribute("data-id");
  const route = await page.locator("table#pending tbody tr").first().locator("td").nth(1).innerText();
  await Promise.all([
    page.waitForURL(/notice=/),
    page.locator(`tr[data-id="${victim}"] button.cancel`).click(),
  ]);
  const notice = await page.locator("#notice").innerText();
  check(notice.includes(`cancelled ${victim}`), `the cancel is confirmed on the page ("${notice}")`);
  check((await api("GET", `/v1/messages/${victim}`)).status === 404, `GET /v1/messages/${victim} is 404 after the cancel`);
  const after = JSON.parse((await api("GET", "/v1/counts")).body);
  check(after.routes[route] === counts.routes[route] - 1, `route ${route} has one message fewer (${after.routes[route]})`);
  check((await page.locator(`tr[data-id="${victim}"]`).count()) === 0, "the cancelled message is gone from the list");
} finally {
  await context.close();
  rmSync(userData, { recursive: true, force: true });
}
