# renice every thread of the workers and API replicas to $1 while they run
N=$1
while true; do
  for pid in $(pgrep -f 'aml-app (worker|serve)'); do
    for t in /proc/$pid/task/*; do
      tid=${t##*/}
      cur=$(awk '{print $19}' $t/stat 2>/dev/null)
      [ "$cur" != "$N" ] && renice -n $N -p $tid >/dev/null 2>&1
    done
  done
  sleep 1
done
