-- tollgate: lease tokens from, and return tokens to, global buckets: one call decides a batch
-- of buckets (each described by 3 KEYS and 16 ARGV, below; a batch's buckets share a Redis
-- Cluster slot), so a sync round costs Redis one command per batch instead of one per key.
--
-- Buckets live as fields of a group hash (KEYS[1]), so that many small buckets share one Redis
-- key and its overhead: a token bucket costs ~20 bytes in a listpack-encoded hash instead of
-- ~130 bytes as a key of its own. Redis TIME is the only clock, so sidecars never disagree
-- about a window.
--
-- KEYS[1]  group hash
-- KEYS[2]  the bucket's block key (same slot): set, with a TTL, by the sidecar that blocked the
--          key for the rule's blockFor; read only when ARGV[14] > 0
-- KEYS[3]  the settlement id's key (same slot), when ARGV[15] is not 0
-- ARGV[1]  field: the bucket id (binary)
-- ARGV[2]  algorithm: 1 token bucket (GCRA), 2 sliding window counter, 3 fixed window
-- ARGV[3]  requests per period
-- ARGV[4]  period in milliseconds
-- ARGV[5]  burst (token bucket capacity)
-- ARGV[6]  want: tokens to take now (may be 0)
-- ARGV[7]  give back: unused tokens returned (may be 0)
-- ARGV[8]  window the returned tokens were taken in (windows only; ignored when it has passed)
-- ARGV[9]  1 = all or nothing (strict and cold requests), 0 = grant as many as available
-- ARGV[10] force: tokens taken unconditionally before the grant, even into debt (costs settled
--          at the response, beyond what was leased or reserved; may be 0)
-- ARGV[11] ahead: token buckets only, and only when not all or nothing: milliseconds into the
--          future the grant may reach. A saturated bucket then grants tokens that become
--          conformant within that horizon, so a sidecar reserves its next interval's tokens in
--          one call instead of coming back for each refill. The caller spends token k of such a
--          grant no earlier than `ready_us - (granted - k) * T`: exactly when the bucket itself
--          would have had it, so reserving ahead never admits a burst above the bucket's own.
-- ARGV[12] demand: tokens requested at the calling sidecar (admitted and refused) since its
--          last report (token buckets; 0: nothing to report)
-- ARGV[13] share period in milliseconds: the interval sidecars report demand over (0: no
--          demand-weighted share). While a bucket is contested (a call wants more than it
--          holds, until the bucket is full again), the fleet's reported demand is kept per
--          window of four periods in a second field (the bucket id and 'd'), and a call that
--          is not all or nothing gets at most its entitlement: a window's refill times the
--          caller's part of the fleet's demand per window (see fair_share). Each sidecar's grants then add up to its part of the refill,
--          whenever it calls: before this, tokens conformant at a call went to whichever
--          sidecar synced first after the refill, and two sidecars with equal demand split a
--          limit 11/89 to 48/52 depending on the phase of their sync rounds. Refill left
--          unclaimed stays in the bucket for the next caller.
-- ARGV[14] blockFor in milliseconds (0: the rule blocks nobody). While the block key exists the
--          call grants nothing (returns and debts still apply), and reports the block's
--          remaining time, so every sidecar learns a block with its next call for the bucket.
-- ARGV[15] settlement id of `force` (0: none), ARGV[16] how long Redis remembers it (ms). A
--          settlement whose id was seen is not applied again: a sidecar that could not tell
--          whether a call carrying a debt landed (a timeout) sends it again with the same id.
-- returns, per bucket in order, {granted, remaining, reset_ms, retry_after_ms, window, ready_us,
--          blocked_ms} flattened into one array: ready_us
--          is how far after Redis's now the last granted token becomes conformant (0 when all
--          are now); blocked_ms how long the key stays blocked (0: not blocked)

-- One bucket: its KEYS from k + 1, its ARGV from a + 1.
local function lease_op(k, a)
  local key, field = KEYS[k + 1], ARGV[a + 1]
  local algo = tonumber(ARGV[a + 2])
  local limit = tonumber(ARGV[a + 3])
  local period = tonumber(ARGV[a + 4])
  local burst = tonumber(ARGV[a + 5])
  local want = tonumber(ARGV[a + 6])
  local back = tonumber(ARGV[a + 7])
  local back_window = tonumber(ARGV[a + 8])
  local all_or_nothing = ARGV[a + 9] == '1'
  local force = tonumber(ARGV[a + 10]) or 0
  local ahead_us = (tonumber(ARGV[a + 11]) or 0) * 1000
  if all_or_nothing then ahead_us = 0 end
  local demand = tonumber(ARGV[a + 12]) or 0
  local share_ms = tonumber(ARGV[a + 13]) or 0
  if force > 0 and (ARGV[a + 15] or '0') ~= '0' then
    if not redis.call('SET', KEYS[k + 3], '1', 'PX', tonumber(ARGV[a + 16]) or 60000, 'NX') then
      force = 0
    end
  end
  local blocked_ms = 0
  if (tonumber(ARGV[a + 14]) or 0) > 0 then
    local b = redis.call('PTTL', KEYS[k + 2])
    if b > 0 then
      blocked_ms = b
      want = 0
    end
  end

  local t = redis.call('TIME')
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local now_ms = math.floor(now_us / 1000)

  local function keep_alive(ms)
    local ttl = redis.call('PTTL', key)
    if ttl < ms then redis.call('PEXPIRE', key, ms) end
  end

  local state = redis.call('HGET', key, field)
  local granted, remaining, reset_ms, retry_ms, window, ready_us = 0, 0, 0, 0, 0, 0

  -- This caller's entitlement in a contested bucket (`every_us`: microseconds per token): the
  -- refill of a demand window times its part of the fleet's demand per window; nil when the
  -- bucket is not contested or no demand was reported. State: 'q<window end ms>,<span ms>,
  -- <current>,<previous>,<ms the contest began>'.
  local function fair_share(every_us, contested, busy)
    if demand <= 0 or share_ms <= 0 then return nil end
    local dfield = field .. 'd'
    local dstate = redis.call('HGET', key, dfield)
    if not (busy or contested) then
      -- A full bucket: nobody is short, forget the demand.
      if dstate then redis.call('HDEL', key, dfield) end
      return nil
    end
    if not (contested or dstate) then return nil end
    -- Demand is measured over four share periods, so that the one or two reports of each
    -- sidecar a one-period window would hold do not swing the estimate.
    local span = 4 * share_ms
    local win = math.floor(now_ms / span)
    local win_end = (win + 1) * span
    local cur, prev, began = 0, 0, now_ms
    if dstate then
      local s_end, s_cur, s_prev, s_began =
        string.match(dstate, '^q(%d+),%d+,(%d+),(%d+),?(%d*)$')
      s_end = tonumber(s_end)
      if s_end == win_end then
        cur, prev, began = tonumber(s_cur), tonumber(s_prev), tonumber(s_began) or now_ms
      elseif s_end == win_end - span then
        prev, began = tonumber(s_cur), tonumber(s_began) or now_ms
      end
    end
    cur = cur + demand
    -- The fleet's demand per span: the last whole span's, or the current one's so far (this
    -- report included) once it is larger. Not a sliding estimate: one that moves with every
    -- report is larger just after another sidecar's report than just before the next, so
    -- sidecars whose rounds follow others closely got ~10 % less than those that did not. A
    -- span the contest began in counts for the part of it that was watched, and the first
    -- span is extrapolated from what it has seen (at least one share period): otherwise the
    -- first callers of a contest are entitled to a whole span's refill.
    local win_start = win * span
    local total
    if prev > 0 then
      local watched = math.max(win_start - math.max(win_start - span, began), share_ms)
      total = math.max(prev * span / watched, cur)
    else
      local watched = math.max(now_ms - math.max(win_start, began), share_ms)
      total = math.max(cur, cur * span / watched)
    end
    redis.call('HSET', key, dfield,
      string.format('q%.0f,%.0f,%.0f,%.0f,%.0f', win_end, span, cur, prev, began))
    -- Each report is entitled to its part of a span's refill: summed over the reports of a
    -- span, the fleet gets the refill (while demand holds steady; never more, since the
    -- schedule bounds every grant), each sidecar in proportion to the demand it reported,
    -- however its calls fall in time. The fraction of a token is granted with that
    -- probability (Redis's microseconds as the coin), so small entitlements are not rounded
    -- away.
    -- A caller with nearly all of the demand (its report read as one share period's) is not
    -- capped: it reserves its whole horizon in one call and skips rounds, as an uncontested
    -- sidecar does, and the others' small entitlements still find room in the schedule.
    if demand * (span / share_ms) >= 0.9 * total then return nil end
    local entitled = (span * 1000 / every_us) * demand / total
    local whole = math.floor(entitled)
    if (now_us % 1000) < (entitled - whole) * 1000 then whole = whole + 1 end
    return whole
  end

  if algo == 1 then
    -- GCRA: tat is the theoretical arrival time in microseconds; the bucket is full when tat <= now.
    -- The arithmetic runs on `lag = tat - now`, not on absolute times: at ~1.8e15 microseconds a
    -- double has a quarter-microsecond resolution, and `now + tau - tat` then came out a hair
    -- under a whole number of tokens, so a full bucket of burst 1 granted nothing.
    local T = period * 1000 / limit
    local tau = burst * T
    local lag = (tonumber(state) or now_us) - now_us
    if lag < 0 then lag = 0 end
    if back > 0 then
      lag = lag - back * T
      if lag < 0 then lag = 0 end
    end
    -- A debt may run the schedule past the burst: later requests wait it off.
    if force > 0 then lag = lag + force * T end
    local available = math.floor((tau - lag) / T + 1e-9)
    if available < 0 then available = 0 end
    -- What the bucket will have had by the end of the horizon (tokens conformant by then).
    local reachable = math.floor((ahead_us + tau - lag) / T + 1e-9)
    if reachable < available then reachable = available end
    -- A contested bucket grants a lease at most its entitlement, tokens conformant now
    -- included; what nobody claimed stays in the bucket for the next caller. All-or-nothing
    -- calls (a request's own cost) are decided by arrival, as an exact bucket decides them.
    local entitled = fair_share(T, want > available, lag > 0)
    if all_or_nothing then entitled = nil end
    if entitled and entitled < reachable then reachable = entitled end
    if want > 0 then
      if want <= available and (not entitled or want <= entitled) then granted = want
      elseif not all_or_nothing then granted = math.min(want, reachable) end
    end
    lag = lag + granted * T
    remaining = available - granted
    -- Tokens an entitlement left in the bucket are the other sidecars' part: to this one the
    -- bucket is empty until its next call (so it refuses locally instead of asking per request).
    if remaining < 0 or (entitled and granted < want) then remaining = 0 end
    if granted > 0 and lag > tau then ready_us = math.ceil(lag - tau) end
    reset_ms = math.ceil(lag / 1000)
    if granted < want then
      retry_ms = math.ceil((lag + want * T - tau) / 1000)
      if retry_ms < 0 then retry_ms = 0 end
    end
    local tat = now_us + lag
    if tat <= now_us then
      redis.call('HDEL', key, field, field .. 'd')
    else
      redis.call('HSET', key, field, string.format('%.0f', math.ceil(tat)))
      keep_alive(reset_ms + 1000)
    end
  else
    -- Windows are aligned to Redis time; state is "<kind><window end ms>,<period ms>,<current>[,<previous>]".
    local win = math.floor(now_ms / period)
    local win_end = (win + 1) * period
    local cur, prev = 0, 0
    if state then
      local s_end, s_period, s_cur, s_prev = string.match(state, '^.(%d+),(%d+),(%d+),?(%d*)$')
      s_end = tonumber(s_end)
      if s_end == win_end then
        cur, prev = tonumber(s_cur), tonumber(s_prev) or 0
      elseif s_end == win_end - period then
        prev = tonumber(s_cur)
      end
    end
    if back > 0 and back_window == win then
      cur = cur - back
      if cur < 0 then cur = 0 end
    end
    cur = cur + force
    local elapsed = now_ms - win * period
    local weight = 0
    if algo == 2 then weight = 1 - elapsed / period end
    local estimated = prev * weight + cur
    local available = math.floor(limit - estimated + 1e-9)
    if available < 0 then available = 0 end
    if want > 0 then
      if want <= available then granted = want elseif not all_or_nothing then granted = available end
    end
    cur = cur + granted
    remaining = available - granted
    reset_ms = win_end - now_ms
    window = win
    if granted < want then
      retry_ms = reset_ms
      if algo == 2 and prev > 0 then
        -- When will the previous window's weight have decayed enough for `want` (all or
        -- nothing), or for one more token (a lease, which takes what there is: it comes back
        -- as soon as there is room rather than when all it wanted fits)?
        local need = want
        if not all_or_nothing then need = 1 end
        local room = limit - cur - need
        if room >= 0 then
          local e = period * (1 - room / prev)
          if e > elapsed then retry_ms = math.ceil(e - elapsed) end
        end
      end
    end
    if algo == 2 then
      if cur == 0 and prev == 0 then
        redis.call('HDEL', key, field)
      else
        redis.call('HSET', key, field, string.format('s%.0f,%.0f,%.0f,%.0f', win_end, period, cur, prev))
        keep_alive(2 * period + 1000)
      end
    else
      if cur == 0 then
        redis.call('HDEL', key, field)
      else
        redis.call('HSET', key, field, string.format('f%.0f,%.0f,%.0f', win_end, period, cur))
        keep_alive(period + 1000)
      end
    end
  end

  -- Drop fields that no longer matter once a group grows, so idle buckets cost nothing even
  -- though hash fields have no TTL of their own.
  if now_us % 16 == 0 and redis.call('HLEN', key) > 64 then
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local v = all[i + 1]
      local first = string.sub(v, 1, 1)
      local dead = false
      if first == 's' or first == 'f' or first == 'q' then
        local e, p = string.match(v, '^.(%d+),(%d+)')
        e, p = tonumber(e), tonumber(p)
        if first == 'f' then dead = now_ms >= e else dead = now_ms >= e + p end
      else
        dead = (tonumber(v) or 0) <= now_us
      end
      if dead then redis.call('HDEL', key, all[i]) end
    end
  end

  return granted, remaining, reset_ms, retry_ms, window, ready_us, blocked_ms
end

local replies = {}
local n = #KEYS / 3
for i = 0, n - 1 do
  local granted, remaining, reset_ms, retry_ms, window, ready_us, blocked_ms =
    lease_op(3 * i, 16 * i)
  local r = #replies
  replies[r + 1], replies[r + 2], replies[r + 3], replies[r + 4] =
    granted, remaining, reset_ms, retry_ms
  replies[r + 5], replies[r + 6], replies[r + 7] = window, ready_us, blocked_ms
end
return replies
