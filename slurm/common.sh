# shellcheck shell=bash
# Shared by slurm/*.sbatch (sourced, never run on its own): Slurm or plain-bash detection,
# the launcher (srun with the site MPI inside an allocation, mpiexec otherwise), checks of
# the documented variables (a bad one is one line naming it, exit 2) and DRY_RUN.
# Variables are documented in each script's header and in docs/SLURM.md.  Internal names
# start with ct_ (functions) or CT_ (variables).  Works with bash >= 4.2 and set -u.

CT_SCRIPT=${CT_SCRIPT:-slurm}

ct_die() {
    echo "$CT_SCRIPT: error: $*" >&2
    exit 2
}

ct_note() {
    echo "$CT_SCRIPT: $*" >&2
}

# ct_int NAME MIN: the variable NAME as a decimal integer >= MIN (normalised in place).
ct_int() {
    local name=$1 min=$2 value=${!1-}
    if [[ ! $value =~ ^[0-9]+$ ]] || (( 10#$value < min )); then
        ct_die "$name='$value' is not a whole number >= $min; $3"
    fi
    printf -v "$name" '%d' "$((10#$value))"
}

# ct_choice NAME CHOICE...: the variable NAME must be one of the choices.
ct_choice() {
    local name=$1 value=${!1-} choice
    shift
    for choice in "$@"; do
        [[ $value == "$choice" ]] && return 0
    done
    ct_die "$name='$value' is not one of: $*"
}

# ct_words NAME: split the variable NAME on whitespace into the array CT_WORDS.
ct_words() {
    CT_WORDS=()
    if [[ -n ${!1-} ]]; then
        read -r -a CT_WORDS <<< "${!1}"
    fi
}

# ct_abs PATH: PATH made absolute against the current directory (need not exist).
ct_abs() {
    if [[ $1 == /* ]]; then
        CT_ABS=$1
    else
        CT_ABS=$PWD/$1
    fi
}

# ct_gpus VALUE: a Slurm GPU count such as "4", "a100:4" or "gpu:a100:4" -> its number.
ct_gpus() {
    CT_GPUS=${1##*:}
    if [[ ! $CT_GPUS =~ ^[0-9]+$ ]]; then
        ct_die "cannot read a GPU count from '$1' (Slurm's GPUs per node); set GPUS_PER_NODE"
    fi
}

# ct_setup: DRY_RUN, the cosmotrain command, Slurm or not, the rank layout.
ct_setup() {
    DRY_RUN=${DRY_RUN:-0}
    ct_choice DRY_RUN 0 1
    ct_find_cosmotrain
    ct_detect
    ct_layout
}

# VENV (optional) is put first on PATH; cosmotrain must then be on PATH, else the
# repository's .venv is used.  CT_COSMOTRAIN is its absolute path (srun's tasks need no
# PATH lookup on the compute nodes).
ct_find_cosmotrain() {
    if [[ -n ${VENV:-} ]]; then
        [[ -x $VENV/bin/cosmotrain ]] ||
            ct_die "VENV='$VENV' has no bin/cosmotrain; set VENV to the virtual environment where cosmotrain is installed"
        ct_abs "$VENV"
        export VIRTUAL_ENV=$CT_ABS
        export PATH=$CT_ABS/bin:$PATH
    elif ! command -v cosmotrain > /dev/null && [[ -x $COSMOTRAIN_REPO/.venv/bin/cosmotrain ]]; then
        export VIRTUAL_ENV=$COSMOTRAIN_REPO/.venv
        export PATH=$VIRTUAL_ENV/bin:$PATH
    fi
    # shellcheck disable=SC2034  # used by the scripts
    CT_COSMOTRAIN=$(command -v cosmotrain) ||
        ct_die "cosmotrain is not on PATH; activate its environment before running (sbatch passes PATH on) or set VENV=/path/to/venv"
}

# Slurm when inside an allocation (SLURM_JOB_ID) with srun on PATH; LAUNCHER overrides.
ct_detect() {
    LAUNCHER=${LAUNCHER:-auto}
    ct_choice LAUNCHER auto srun mpiexec
    CT_SLURM=0
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        CT_SLURM=1
    fi
    case $LAUNCHER in
        srun)
            [[ $CT_SLURM == 1 ]] || ct_die "LAUNCHER=srun needs a Slurm allocation (SLURM_JOB_ID is not set); submit with sbatch or use LAUNCHER=mpiexec"
            command -v srun > /dev/null || ct_die "LAUNCHER=srun but srun is not on PATH"
            ;;
        auto)
            if [[ $CT_SLURM == 1 ]] && ! command -v srun > /dev/null; then
                ct_note "SLURM_JOB_ID is set but srun is not on PATH: launching with mpiexec"
                LAUNCHER=mpiexec
            elif [[ $CT_SLURM == 1 ]]; then
                LAUNCHER=srun
            else
                LAUNCHER=mpiexec
            fi
            ;;
    esac
}

# NODES, TASKS_PER_NODE, CPUS_PER_TASK, GPUS_PER_NODE: the caller's values, else the
# allocation's (Slurm), else one node, one task, the node's cores, no GPU.  NTASKS.
ct_layout() {
    local cores
    cores=$(nproc 2> /dev/null || getconf _NPROCESSORS_ONLN 2> /dev/null || echo 1)
    if [[ $CT_SLURM == 1 ]]; then
        NODES=${NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
        if [[ -z ${GPUS_PER_NODE:-} ]]; then
            ct_gpus "${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
            GPUS_PER_NODE=$CT_GPUS
        fi
        cores=${SLURM_CPUS_ON_NODE:-$cores}
    else
        NODES=${NODES:-1}
        GPUS_PER_NODE=${GPUS_PER_NODE:-0}
    fi
    ct_int NODES 1 "set NODES to the number of nodes, e.g. NODES=2"
    ct_int GPUS_PER_NODE 0 "set GPUS_PER_NODE to the GPUs of each node (0 for none)"
    if [[ -z ${TASKS_PER_NODE:-} ]]; then
        if [[ $CT_SLURM == 1 && -n ${SLURM_NTASKS_PER_NODE:-} ]]; then
            TASKS_PER_NODE=$SLURM_NTASKS_PER_NODE
        elif [[ $CT_SLURM == 1 && ${SLURM_NTASKS:-x} =~ ^[0-9]+$ ]] \
                && (( SLURM_NTASKS % NODES == 0 )); then
            TASKS_PER_NODE=$((SLURM_NTASKS / NODES))
        elif (( GPUS_PER_NODE > 0 )); then
            TASKS_PER_NODE=$GPUS_PER_NODE  # one rank per GPU
        else
            TASKS_PER_NODE=1
        fi
    fi
    ct_int TASKS_PER_NODE 1 "set TASKS_PER_NODE to the MPI ranks per node (one per GPU on GPU nodes)"
    if (( GPUS_PER_NODE > 0 && TASKS_PER_NODE != GPUS_PER_NODE )); then
        ct_note "note: $TASKS_PER_NODE rank(s) per node on $GPUS_PER_NODE GPU(s) per node; cosmotrain runs one rank per GPU (TASKS_PER_NODE=$GPUS_PER_NODE)"
    fi
    if [[ -z ${CPUS_PER_TASK:-} ]]; then
        if [[ $CT_SLURM == 1 && -n ${SLURM_CPUS_PER_TASK:-} ]]; then
            CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
        elif [[ $cores =~ ^[0-9]+$ ]] && (( cores >= TASKS_PER_NODE )); then
            CPUS_PER_TASK=$((cores / TASKS_PER_NODE))
        else
            CPUS_PER_TASK=1
        fi
    fi
    ct_int CPUS_PER_TASK 1 "set CPUS_PER_TASK to the cores of each rank"
    if [[ $CT_SLURM == 1 && ${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}} =~ ^[0-9]+$ ]] \
            && (( NODES > ${SLURM_JOB_NUM_NODES:-$SLURM_NNODES} )); then
        ct_die "NODES=$NODES but job ${SLURM_JOB_ID} has ${SLURM_JOB_NUM_NODES:-$SLURM_NNODES} node(s); submit with sbatch --nodes=$NODES or lower NODES"
    fi
    NTASKS=$((NODES * TASKS_PER_NODE))
}

# CT_LAUNCH: the launcher's words (srun ... or mpiexec -n N ...; empty for one rank
# without an mpiexec).  Thread counts of every rank follow CPUS_PER_TASK.
ct_launcher() {
    if [[ $LAUNCHER == srun ]]; then
        CT_LAUNCH=(srun "--nodes=$NODES" "--ntasks=$NTASKS" "--ntasks-per-node=$TASKS_PER_NODE"
                   "--cpus-per-task=$CPUS_PER_TASK" --kill-on-bad-exit=1)
        if (( GPUS_PER_NODE > 0 )); then
            CT_LAUNCH+=("--gpus-per-node=$GPUS_PER_NODE" "--gpu-bind=${GPU_BIND:-closest}")
        fi
        if [[ -n ${SRUN_MPI:-} ]]; then
            CT_LAUNCH+=("--mpi=$SRUN_MPI")
        fi
        ct_words SRUN_ARGS
    else
        if command -v "${MPIEXEC:-mpiexec}" > /dev/null; then
            CT_LAUNCH=("$(command -v "${MPIEXEC:-mpiexec}")" -n "$NTASKS")
        elif (( NTASKS == 1 )) && [[ -z ${MPIEXEC:-} ]]; then
            CT_LAUNCH=()  # one rank: MPI starts as a singleton
        else
            ct_die "${MPIEXEC:-mpiexec} not found on PATH (MPIEXEC); install cosmotrain with its MPI (pip install -e \".[mpich]\") or load the site MPI (module load ...)"
        fi
        if (( NODES > 1 )) && [[ -z ${MPIEXEC_ARGS:-} ]]; then
            ct_note "NODES=$NODES without Slurm: mpiexec needs a host file, e.g. MPIEXEC_ARGS='-f hosts -ppn $TASKS_PER_NODE'"
        fi
        ct_words MPIEXEC_ARGS
    fi
    CT_LAUNCH+=(${CT_WORDS[@]+"${CT_WORDS[@]}"})
}

# ct_threads: one OpenMP / BLAS thread per core of a rank (the ranks inherit them).
ct_threads() {
    export OMP_NUM_THREADS=$CPUS_PER_TASK OPENBLAS_NUM_THREADS=$CPUS_PER_TASK \
        MKL_NUM_THREADS=$CPUS_PER_TASK
    ct_print "export OMP_NUM_THREADS=$CPUS_PER_TASK OPENBLAS_NUM_THREADS=$CPUS_PER_TASK MKL_NUM_THREADS=$CPUS_PER_TASK"
}

# ct_config NAME: the config file in variable NAME, found against the current directory
# or the repository, made absolute in place.
ct_config() {
    local name=$1 value=${!1-}
    [[ -n $value ]] || ct_die "$name is not set; set $name to a config file, e.g. $name=configs/cosmoflow-128.yaml"
    if [[ -f $value ]]; then
        ct_abs "$value"
    elif [[ $value != /* && -f $COSMOTRAIN_REPO/$value ]]; then
        CT_ABS=$COSMOTRAIN_REPO/$value
    else
        ct_die "$name='$value': no such file (looked in $PWD and $COSMOTRAIN_REPO); see configs/"
    fi
    printf -v "$name" '%s' "$CT_ABS"
}

# ct_sets: SETS ("key=value key=value") -> CT_SETS (--set key=value ...).
ct_sets() {
    local item
    CT_SETS=()
    ct_words SETS
    for item in ${CT_WORDS[@]+"${CT_WORDS[@]}"}; do
        if [[ $item != *=* || $item == -* ]]; then
            ct_die "SETS item '$item' is not key=value; write SETS='train.batch_size=16 model.width=64' (space separated, no --set)"
        fi
        CT_SETS+=(--set "$item")
    done
}

# ct_header: a comment line describing the launch.
ct_header() {
    local where="plain bash"
    if [[ $CT_SLURM == 1 ]]; then
        where="Slurm job $SLURM_JOB_ID"
    fi
    echo "# $CT_SCRIPT ($where): $LAUNCHER, $NODES node(s) x $TASKS_PER_NODE task(s) = $NTASKS rank(s), $CPUS_PER_TASK CPU(s) per task, $GPUS_PER_NODE GPU(s) per node"
}

# ct_print LINE: a command line as DRY_RUN shows it ("+ LINE" when it really runs).
ct_print() {
    if [[ $DRY_RUN == 1 ]]; then
        echo "$1"
    else
        echo "+ $1"
    fi
}

# ct_run WORD...: print the command (words quoted for the shell only where needed);
# run it unless DRY_RUN=1.
ct_run() {
    local line="" word
    for word in "$@"; do
        if [[ ! $word =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            word="'${word//\'/\'\\\'\'}'"
        fi
        line+="${line:+ }$word"
    done
    ct_print "$line"
    if [[ $DRY_RUN != 1 ]]; then
        "$@"
    fi
}
