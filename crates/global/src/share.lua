-- tollgate: RLQS fleet shares. Each server replica publishes, per bucket, the demand its
-- Envoys reported and the rate it assigned them, and reads what the other replicas hold, so
-- every replica splits the limit by fleet-wide demand and the sum of assignments stays within
-- the limit. One call carries a batch of buckets (on Redis Cluster, one bucket: each bucket's
-- hash is its own slot), so an exchange costs one command per batch, not one per bucket.
-- KEYS[i]  hash of bucket i: field = replica id, value = "demand assigned streams lapse_ms"
-- ARGV[1]  replica id
-- ARGV[2]  how long an entry lives without a refresh, milliseconds
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2]  for bucket i: this replica's demand and the rate it
--          assigned (both milli-requests per second), and its Envoy streams on the bucket
--          (0 = leave)
-- returns, per bucket in order, {other replicas' demand, their assigned rate (both milli),
--          their streams} flattened into one array
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replica = ARGV[1]
local life = tonumber(ARGV[2])
local replies = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local my_demand, my_assigned, my_streams = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local demand, assigned, streams = 0, 0, 0
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    local field = all[j]
    if field ~= replica then
      local d, a, s, lapse = string.match(all[j + 1], '^(%d+) (%d+) (%d+) (%d+)$')
      if lapse and tonumber(lapse) > now then
        demand = demand + tonumber(d)
        assigned = assigned + tonumber(a)
        streams = streams + tonumber(s)
      else
        redis.call('HDEL', key, field)
      end
    end
  end
  if tonumber(my_streams) > 0 then
    redis.call('HSET', key, replica, my_demand .. ' ' .. my_assigned .. ' ' .. my_streams .. ' ' .. (now + life))
    redis.call('PEXPIRE', key, life * 2)
  else
    redis.call('HDEL', key, replica)
  end
  local r = #replies
  replies[r + 1], replies[r + 2], replies[r + 3] = demand, assigned, streams
end
return replies
