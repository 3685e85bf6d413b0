-- tollgate: RLQS fleet shares. Each server replica publishes, per bucket, the demand its
-- Envoys reported and the rate it assigned them, and reads what the other replicas hold, so
-- every replica splits the limit by fleet-wide demand and the sum of assignments stays within
-- the limit.
-- KEYS[1]  hash of the bucket: field = replica id, value = "demand assigned streams lapse_ms"
-- ARGV[1]  replica id
-- ARGV[2]  this replica's demand, milli-requests per second
-- ARGV[3]  the rate this replica assigned, milli-requests per second
-- ARGV[4]  this replica's Envoy streams on the bucket (0 = leave)
-- ARGV[5]  how long the entry lives without a refresh, milliseconds
-- returns {other replicas' demand, their assigned rate (both milli), their streams}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local life = tonumber(ARGV[5])
local demand, assigned, streams = 0, 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local field = all[i]
  if field ~= ARGV[1] then
    local d, a, s, lapse = string.match(all[i + 1], '^(%d+) (%d+) (%d+) (%d+)$')
    if lapse and tonumber(lapse) > now then
      demand = demand + tonumber(d)
      assigned = assigned + tonumber(a)
      streams = streams + tonumber(s)
    else
      redis.call('HDEL', KEYS[1], field)
    end
  end
end
if tonumber(ARGV[4]) > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. (now + life))
  redis.call('PEXPIRE', KEYS[1], life * 2)
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return {demand, assigned, streams}
