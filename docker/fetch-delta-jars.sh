#!/bin/sh
# Resolve delta-spark and everything its published POM needs into one folder,
# and point spark.jars at them. Used at image build by both Dockerfiles.
#
#   fetch-delta-jars.sh SPARK_SUBMIT COORDINATE JAR_DIR SPARK_DEFAULTS_FILE
#
# Spark's own Ivy resolver does the work (the same as `--packages`), so the
# transitive set (delta-storage, delta-kernel-*, Unity Catalog client, ...) is
# exactly what Delta publishes for this version, and Ivy checks every artifact
# against the repository's checksum. The two jars named in the coordinate are
# additionally compared with the SHA-1 Maven Central publishes next to them.
#
# spark.jars rather than $SPARK_HOME/jars: jars added this way sit behind
# Spark's own classpath (parent-first), so a transitive library that Spark
# also ships (Jackson, SLF4J) cannot shadow Spark's version.
set -eu

spark_submit=$1
coordinate=$2
jar_dir=$3
defaults_file=$4
central=https://repo1.maven.org/maven2

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: > "$work/noop.py"
# A script that does nothing: spark-submit resolves --packages before it runs.
"$spark_submit" --master 'local[1]' --packages "$coordinate" \
    --conf "spark.jars.ivy=$work/ivy" "$work/noop.py"

mkdir -p "$jar_dir"
cp "$work"/ivy/jars/*.jar "$jar_dir"/

group=$(echo "$coordinate" | cut -d: -f1)
artifact=$(echo "$coordinate" | cut -d: -f2)
version=$(echo "$coordinate" | cut -d: -f3)
for name in "$artifact" delta-storage; do
    jar="$jar_dir/${group}_${name}-${version}.jar"
    test -f "$jar" || { echo "missing $jar after resolving $coordinate" >&2; exit 1; }
    url="$central/$(echo "$group" | tr . /)/$name/$version/$name-$version.jar.sha1"
    expected=$(curl -fsSL "$url" | cut -c1-40)
    echo "$expected  $jar" | sha1sum -c -
done

mkdir -p "$(dirname "$defaults_file")"
jars=$(find "$jar_dir" -name '*.jar' | sort | paste -sd, -)
echo "spark.jars $jars" >> "$defaults_file"
