# The phase mechanism of the GPU recipes (tools/gpu_run.sh, tools/gpu_real17.sh), sourced by them: work in phases
# that survive the 10-minute limit of one device call. A finished phase leaves a stamp under $state, so running
# the same command again (on the same, still warm machine) goes on where the last call stopped; a phase that
# would not fit in the time left waits for the next call.
# The sourcing script sets: state (stamps), logs (one log per phase and summary.md), out (what comes back),
# deadline (epoch seconds), ALWAYS (phase names that ONLY never filters out). Users set SKIP="a b" to skip phases,
# ONLY=prefix to run only the phases whose name starts so (besides those in ALWAYS).

finish() {
    tar czf "$out/logs.tgz" -C "$(dirname "$logs")" "$(basename "$logs")"
    cp "$logs/summary.md" "$out/summary.md" 2>/dev/null
    exit "$1"
}
left() { echo $(( deadline - $(date +%s) )); }

# phase NAME SECONDS_NEEDED CMD...: run CMD (from /tmp, so the source tree never shadows the installed package)
# unless it is stamped done; stamp it unless it timed out. Not enough time left: end this call.
phase() {
    local name=$1 need=$2; shift 2
    [ -e "$state/$name.done" ] && return 0
    case " ${SKIP:-} " in *" $name "*) return 0 ;; esac
    case " ${ALWAYS:-} " in *" $name "*) ;; *) [[ "$name" == "${ONLY:-}"* ]] || return 0 ;; esac
    if [ "$(left)" -lt "$need" ]; then
        echo "[$name] needs ~${need} s, $(left) s left: run again" | tee -a "$logs/summary.md"
        finish 0
    fi
    local t0 rc
    t0=$(date +%s)
    (cd /tmp && timeout "$(left)" bash -c '"$@"' _ "$@") > "$logs/$name.log" 2>&1
    rc=$?
    echo "[$name] rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$logs/summary.md"
    tail -n 25 "$logs/$name.log" | tee -a "$logs/summary.md"
    if [ $rc -eq 124 ]; then echo "[$name] timed out: run again" | tee -a "$logs/summary.md"; finish 0; fi
    touch "$state/$name.done"
    return $rc
}
